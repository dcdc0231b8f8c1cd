"""Hugging Face model folders (``config.json`` + ``*.safetensors``) loaded directly by
``Llama.build``: one of each family, saved by transformers' own ``save_pretrained``, against
transformers' forward pass on the same input; each rank's slices against what the Meta loader
reads from the same weights converted by ``python -m llama.convert hf_to_meta``; the folder
split over two torchrun processes against one; and the errors for a folder that is neither.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import helpers
import llama4_helpers as H
from llama import Llama
from llama.checkpoint.hf import iter_hf_rank_tensors, open_hf_checkpoint
from llama.checkpoint.layout import checkpoint_layout, find_tokenizer
from llama.checkpoint.shards import find_shards, inspect_checkpoint, iter_rank_tensors
from llama.convert import hf_to_meta
from llama.layers.tensor_parallel import choose_embedding_layout, full_shapes, shard_shape, tensor_names
from llama.tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

SEQ = 40


def _randomize(model, seed: int):
    """O(1) activations and non-trivial norms (so a swapped norm or a wrong row order shows)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-2 if "experts" in name else -1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.float().eval()


def llama2_folder(root: Path, sp_tokenizer_path: Path):
    """Llama 2 / Code Llama shape: multi-head attention, RoPE theta 1e4, untied output,
    tokenizer.model (SentencePiece) beside the weights, as meta-llama/Llama-2-7b-hf has it."""
    vocab = load_tokenizer(sp_tokenizer_path).n_words
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=None)
    config._attn_implementation = "eager"
    model = _randomize(transformers.LlamaForCausalLM(config), 21)
    model.save_pretrained(root)
    shutil.copyfile(sp_tokenizer_path, root / "tokenizer.model")
    return root, model


def llama3_folder(root: Path, tiktoken_path: Path):
    """Llama 3.2 shape: grouped-query attention, Llama 3.1 RoPE scaling (original context 32,
    so it acts within the sequences tested), tied embeddings (no lm_head), the weights in two
    safetensors files with an index, Meta's tokenizer under original/."""
    vocab = load_tokenizer(tiktoken_path).n_words
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        tie_word_embeddings=True, bos_token_id=300, eos_token_id=301, pad_token_id=None)
    config._attn_implementation = "eager"
    model = _randomize(transformers.LlamaForCausalLM(config), 22)
    model.save_pretrained(root, max_shard_size="150KB")
    (root / "original").mkdir()
    shutil.copyfile(tiktoken_path, root / "original" / "tokenizer.model")
    return root, model


def llama4_folder(root: Path, tiktoken_path: Path):
    """Llama 4 text (Llama4ForCausalLM): MoE every 2nd layer, a NoPE layer, chunked attention,
    QK norm; tokenizer.model beside the weights."""
    vocab = load_tokenizer(tiktoken_path).n_words
    params = {**H.LLAMA4_PARAMS, "vocab_size": vocab}
    model = H.build_hf_llama4(params, H.random_llama4_weights(params, vocab, seed=23), max_pos=256)
    model.save_pretrained(root)
    shutil.copyfile(tiktoken_path, root / "tokenizer.model")
    return root, model


FAMILIES = {"llama2": llama2_folder, "llama3": llama3_folder, "llama4": llama4_folder}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, sp_tokenizer_path, tiny_tiktoken_path):
    """family -> (HF folder, the transformers model saved there), made once for the module."""
    out = {}
    for family, make in FAMILIES.items():
        tokenizer = sp_tokenizer_path if family == "llama2" else tiny_tiktoken_path
        out[family] = make(tmp_path_factory.mktemp(f"hf_{family}"), tokenizer)
    return out


def tokens_for(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_folder_gives_transformers_logits(folders, family):
    path, hf = folders[family]
    assert checkpoint_layout(path) == "hf"
    llama = Llama.build(path, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32")  # tokenizer found
    expected_tokenizer = SentencePieceTokenizer if family == "llama2" else TiktokenTokenizer
    assert isinstance(llama.tokenizer, expected_tokenizer)
    assert llama.model.params.is_llama4 == (family == "llama4")
    tokens = tokens_for(hf.config.vocab_size, seed=len(family))
    ours = llama.model.forward(tokens, 0)
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    assert ours.shape == theirs.shape
    assert helpers.rel_err(ours, theirs) < 1e-4  # as tests/test_hf_parity.py


@pytest.mark.parametrize("family, world_size", [("llama2", 2), ("llama3", 2), ("llama3", 4), ("llama4", 2)])
def test_each_rank_reads_what_the_meta_loader_reads_from_the_converted_checkpoint(folders, tmp_path, family,
                                                                                 world_size):
    """Every rank's slice of every tensor, read straight from the HF folder, equals the slice
    the Meta loader reads for that rank from ``hf_to_meta``'s output (which reads each HF
    tensor whole).  With 4 ranks over Llama 3's 2 K/V heads, each K/V head is copied."""
    path, _ = folders[family]
    hf_to_meta(path, tmp_path / "meta")
    hf = open_hf_checkpoint(path, max_seq_len=64, max_batch_size=1)
    args = hf.args
    info = inspect_checkpoint(find_shards(tmp_path / "meta"), args)
    layout = choose_embedding_layout(None, args, world_size)
    shapes = full_shapes(args)
    cpu = torch.device("cpu")
    for rank in range(world_size):
        local = {name: torch.Size(shard_shape(name, shapes[name], world_size, rank, layout, args.head_dim))
                 for name in tensor_names(args)}
        ours = dict(iter_hf_rank_tensors(hf, local, layout, world_size, rank, cpu, torch.float32))
        meta = dict(iter_rank_tensors(info, args, local, layout, world_size, rank, cpu, torch.float32))
        assert list(ours) == list(local)
        for name in local:
            assert torch.equal(ours[name], meta[name]), (rank, name)


def test_pytorch_model_bin_folder_loads(folders, tmp_path):
    """Older Hugging Face saves hold pytorch_model.bin (read memory-mapped, no pickled code run)."""
    from safetensors.torch import load_file

    path, hf = folders["llama2"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copyfile(path / name, bin_dir / name)
    torch.save(dict(load_file(path / "model.safetensors")), bin_dir / "pytorch_model.bin")
    assert checkpoint_layout(bin_dir) == "hf"
    llama = Llama.build(bin_dir, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32")
    tokens = tokens_for(hf.config.vocab_size, seed=4)
    with torch.no_grad():
        assert helpers.rel_err(llama.model.forward(tokens, 0), hf(tokens).logits) < 1e-4


def test_multimodal_llama4_folder_loads_its_language_model(folders, tmp_path, caplog):
    """A Llama4ForConditionalGeneration folder as published (language_model.* names, the text
    config inside a 'llama4' config, vision tensors beside): the text model loads, the vision
    tensors are skipped with a note, and never read."""
    import json
    import logging

    from safetensors.torch import load_file, save_file

    path, hf = folders["llama4"]
    mm = tmp_path / "mm"
    mm.mkdir()
    text_config = json.loads((path / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures": [
        "Llama4ForConditionalGeneration"], "text_config": text_config, "vision_config": {"hidden_size": 8}}))
    state = {("language_model." + k): v for k, v in load_file(path / "model.safetensors").items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.randn(8, 12)
    state["multi_modal_projector.linear_1.weight"] = torch.randn(64, 8)
    save_file(state, str(mm / "model.safetensors"))
    shutil.copyfile(path / "tokenizer.model", mm / "tokenizer.model")
    with caplog.at_level(logging.INFO, logger="llama.checkpoint"):
        llama = Llama.build(mm, max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32")
    assert "skipping 2 vision tensors" in caplog.text
    tokens = tokens_for(hf.config.vocab_size, seed=3)
    with torch.no_grad():
        assert helpers.rel_err(llama.model.forward(tokens, 0), hf(tokens).logits) < 1e-4


def test_quantised_load_of_an_hf_folder_is_that_of_its_meta_conversion(folders, tmp_path):
    """quantize="int8" quantises each layer as it is read from the HF folder: bit for bit what
    loading hf_to_meta's output gives."""
    path, hf = folders["llama3"]
    hf_to_meta(path, tmp_path / "meta")
    tokens = tokens_for(hf.config.vocab_size, seed=7)
    options = dict(max_seq_len=64, max_batch_size=2, device="cpu", dtype="float32", quantize="int8")
    ours = Llama.build(path, **options).model.forward(tokens, 0)
    theirs = Llama.build(tmp_path / "meta", **options).model.forward(tokens, 0)
    assert torch.equal(ours, theirs)


def test_reads_only_this_ranks_slices(folders, monkeypatch):
    """Rank 1 of 2 asks the safetensors files for its half of each split tensor, never a whole one."""
    from llama.convert.hf_weights import HFWeights

    path, _ = folders["llama3"]
    hf = open_hf_checkpoint(path, max_seq_len=64, max_batch_size=1)
    args = hf.args
    asked = []
    get_region = HFWeights.get_region

    def recording(self, name, region):
        out = get_region(self, name, region)
        asked.append((name, out.numel(), self.shape(name)))
        return out

    monkeypatch.setattr(HFWeights, "get_region", recording)
    shapes = full_shapes(args)
    local = {name: torch.Size(shard_shape(name, shapes[name], 2, 1, "vocab", args.head_dim))
             for name in tensor_names(args)}
    dict(iter_hf_rank_tensors(hf, local, "vocab", 2, 1, torch.device("cpu"), torch.float32))
    for name, read, shape in asked:
        whole = torch.Size(shape).numel()
        assert read == (whole if name.endswith("norm.weight") else whole // 2), name


def test_tied_folder_has_no_lm_head_and_builds_its_output_from_the_embedding(folders):
    path, hf = folders["llama3"]
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    ckpt = open_hf_checkpoint(path, max_seq_len=64, max_batch_size=1)
    assert ckpt.tied and "lm_head.weight" not in ckpt.weights.location


# -- which layout, which tokenizer, and the errors -------------------------------------------


def test_meta_checkpoint_is_still_meta(llama3_checkpoint, tmp_path):
    ckpt = llama3_checkpoint.ckpt_dir
    assert checkpoint_layout(ckpt) == "meta"
    with pytest.raises(FileNotFoundError, match="no tokenizer in the Meta checkpoint .*tokenizer_path"):
        find_tokenizer(ckpt)  # this one keeps its tokenizer elsewhere
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    shutil.copyfile(llama3_checkpoint.tokenizer_path, copy / "tokenizer.model")
    assert find_tokenizer(copy) == copy / "tokenizer.model"
    llama = Llama.build(copy, max_seq_len=32, max_batch_size=1, device="cpu")
    assert llama.tokenizer.n_words == load_tokenizer(llama3_checkpoint.tokenizer_path).n_words


def _says_both_layouts(message: str) -> None:
    assert "params.json" in message and "consolidated" in message, message  # Meta's
    assert "config.json" in message and "safetensors" in message, message  # Hugging Face's


def test_empty_folder_names_both_layouts(tmp_path, tiny_tiktoken_path):
    with pytest.raises(FileNotFoundError) as e:
        Llama.build(tmp_path, max_seq_len=32, max_batch_size=1, device="cpu")
    _says_both_layouts(str(e.value))
    assert "holds nothing" in str(e.value)
    # the same with a tokenizer given: the checkpoint is what is missing
    with pytest.raises(FileNotFoundError) as e:
        Llama.build(tmp_path, tiny_tiktoken_path, max_seq_len=32, max_batch_size=1, device="cpu")
    _says_both_layouts(str(e.value))


def test_folder_that_is_neither_names_both_layouts_and_what_it_holds(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a config without weights (an unfinished download)
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError) as e:
        checkpoint_layout(tmp_path)
    _says_both_layouts(str(e.value))
    assert "config.json, weights.gguf" in str(e.value)
    (tmp_path / "original").mkdir()  # only Meta's copy of a Hugging Face repository downloaded
    (tmp_path / "original" / "params.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"original/ folder holds Meta's files: pass {tmp_path / 'original'}"):
        checkpoint_layout(tmp_path)


def test_hf_folder_without_a_tokenizer_says_which_file_to_pass(folders, tmp_path):
    path, _ = folders["llama4"]
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in path.iterdir():
        if f.name != "tokenizer.model":
            (bare / f.name).symlink_to(f)
    with pytest.raises(FileNotFoundError, match="tokenizer_path") as e:
        Llama.build(bare, max_seq_len=32, max_batch_size=1, device="cpu")
    assert "tokenizer.model" in str(e.value) and "tokenizer.json" in str(e.value)


def test_examples_resolve_an_hf_folder_and_its_tokenizer(folders, tmp_path):
    from llama.cli.examples import resolve_checkpoint

    path, _ = folders["llama3"]
    assert resolve_checkpoint(str(path), None) == (path, path / "original" / "tokenizer.model")
    with pytest.raises(FileNotFoundError) as e:
        resolve_checkpoint(str(tmp_path), None)
    _says_both_layouts(str(e.value))


def test_config_json_that_the_weights_do_not_match_is_refused_before_loading(folders, tmp_path):
    import json

    path, _ = folders["llama2"]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 192
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight.*config.json"):
        Llama.build(copy, max_seq_len=32, max_batch_size=1, device="cpu")


# -- tokenizer.json --------------------------------------------------------------------------


def _tokenizer_json(tokenizer, out: Path) -> Path:
    """``tokenizer``'s Hugging Face tokenizer.json, as llama.convert's meta_to_hf writes it."""
    import json

    from llama.convert.hf_tokenizer import hf_tokenizer_files

    out.write_text(json.dumps(hf_tokenizer_files(tokenizer, 128)["tokenizer.json"]))
    return out


TEXTS = ["the cat sat on the mat", "Hello\n\n  world, again!", "na\u00efve caf\u00e9 12345 \U0001F600", ""]


@pytest.mark.parametrize("family", [TiktokenTokenizer, Llama4Tokenizer])
def test_tokenizer_json_encodes_as_tokenizer_model_and_transformers(tiny_tiktoken_path, tmp_path, family):
    """A Llama 3 / Llama 4 tokenizer.json is read as the same tokenizer as Meta's tokenizer.model
    (family told from its control tokens), and encodes as transformers' own reading of it."""
    meta = family(tiny_tiktoken_path)
    ours = load_tokenizer(_tokenizer_json(meta, tmp_path / "tokenizer.json"))
    assert type(ours) is family
    assert (ours.n_words, ours.bos_id, ours.stop_tokens) == (meta.n_words, meta.bos_id, meta.stop_tokens)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text, bos=True, eos=False) == meta.encode(text, bos=True, eos=False)
        assert ours.encode(text, bos=False, eos=False) == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ours.encode(text, bos=False, eos=False)) == text


def test_llama2_tokenizer_json_is_refused_naming_tokenizer_model(sp_tokenizer_path, tmp_path):
    path = _tokenizer_json(load_tokenizer(sp_tokenizer_path), tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.model beside it with --tokenizer_path"):
        load_tokenizer(path)


def test_llama3_folder_with_only_tokenizer_json_builds(folders, tmp_path):
    """As a Hugging Face download without original/ leaves it."""
    path, hf = folders["llama3"]
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in path.iterdir():
        if f.name != "original":
            (bare / f.name).symlink_to(f)
    meta = load_tokenizer(path / "original" / "tokenizer.model")
    _tokenizer_json(meta, bare / "tokenizer.json")
    assert find_tokenizer(bare) == bare / "tokenizer.json"
    llama = Llama.build(bare, max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    assert llama.tokenizer.model_path == str(bare / "tokenizer.json")
    assert llama.tokenizer.encode("the cat", bos=True, eos=False) == meta.encode("the cat", bos=True, eos=False)
    out = llama.text_completion(["the cat"], max_gen_len=4, temperature=0)
    assert isinstance(out[0]["generation"], str)


@pytest.mark.slow
def test_real_llama3_tokenizer_json(llama3_tokenizer_path, tmp_path):
    """Meta's Llama 3 tokenizer.model against its tokenizer.json (128,256 ids), and transformers."""
    meta = load_tokenizer(llama3_tokenizer_path)
    ours = load_tokenizer(_tokenizer_json(meta, tmp_path / "tokenizer.json"))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert type(ours) is TiktokenTokenizer and ours.n_words == 128256
    for text in TEXTS + ["def f(x):\n    return x ** 2  # \u4f60\u597d"]:
        assert ours.encode(text, bos=False, eos=False) == meta.encode(text, bos=False, eos=False) \
            == theirs(text, add_special_tokens=False)["input_ids"]


# -- two processes ---------------------------------------------------------------------------

WORKER = Path(__file__).parent / "hf_mp_worker.py"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hf_folder_on_two_processes_gives_the_text_of_one(folders, tmp_path):
    from hf_mp_worker import workload

    path, hf = folders["llama3"]
    single = workload(Llama.build(path, max_seq_len=64, max_batch_size=2, device="cpu"))
    out = tmp_path / "out"
    out.mkdir()
    proc = helpers.torchrun(WORKER, [str(path), str(out)], nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert r["text"] == single["text"]
        assert r["greedy"] == single["greedy"]
        assert helpers.rel_err(r["logits"], single["logits"]) < 1e-5  # only the order of sums differs
    assert sum(len(g) for g in single["greedy"]) > 10  # real decoding was compared


# -- the examples and the server -------------------------------------------------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(helpers.REPO), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow
def test_chat_example_runs_an_hf_folder_with_its_own_tokenizer(folders, monkeypatch, capsys, root_logger_kept):
    """The text example takes its checkpoint the same way (llama.cli.examples.resolve_checkpoint,
    tested above without a process).  The chat example's ``main`` in this process (a process of
    its own was another import of torch; tests/test_examples.py runs the scripts as processes)."""
    from test_images_chat import example_output

    path = folders["llama3"][0]
    out = example_output(monkeypatch, capsys, ["--ckpt_dir", str(path), "--max_gen_len", "6", "--temperature", "0",
                                               "--device", "cpu"])
    assert out.count("==================================") >= 3 and out.count("> ") >= 3


@pytest.mark.slow
def test_server_serves_an_hf_folder(folders, tmp_path):
    """``python -m llama.serve --ckpt_dir <HF folder>``: its greedy completion is
    ``Llama.build``'s on the same folder; the process ends with the test."""
    httpx = pytest.importorskip("httpx")
    path, _ = folders["llama3"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "llama.serve", "--ckpt_dir", str(path), "--port", str(port),
                             "--device", "cpu", "--max_seq_len", "64", "--max_batch_size", "2"],
                            cwd=helpers.REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        reply = httpx.post(url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "temperature": 0},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        served = reply.json()["choices"][0]["text"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()
    llama = Llama.build(path, max_seq_len=64, max_batch_size=2, device="cpu")
    assert served == llama.text_completion(["the cat"], max_gen_len=6, temperature=0)[0]["generation"]
    assert reply.json()["model"] == path.name
