"""Our own CPU kernels for int8 and int4 weight products (``csrc/qmatmul.cpp``), built with
torch's C++ extension tooling on first use and cached on disk, and their pure-torch twins.

They multiply as llama.cpp's CPU backend does: each activation row is quantised to int8
once per product, in blocks of 32 values with one scale each (Q8_0's activations), and
multiplied by integer dot products with the CPU's instructions (AVX-512 VNNI, or AVX2), the
output rows split over torch's threads.

* int8: the layer's own (out, in) int8 weight and its scale per row, nothing repacked; the
  activations' blocks of 32 are strided so that a vector lane sums a block over 512 values
  (:func:`q8_block_index`) before it scales: one conversion and multiply per 512 weights.
  With AVX-512 VNNI a tile multiplies up to 8 activation rows (a decoding batch) by each
  weight vector it loads, so a batch of 8 reads the weight once; for fewer rows it takes up
  to 8 weight rows, each read from its start to its end before the next (one stream from
  memory at a time: AMD Zen 4's prefetchers lose a pattern that steps from row to row).
* int4: the same codes, scales and offsets as the int4 layers' (groups of 32 or more,
  ``W = (q - 8) * scale + offset``), laid out by :func:`pack_int4` for the kernel: per row,
  chunks of 16 blocks of 32 values (512), so that one 32-bit lane of a vector accumulates one
  block.  A chunk is 4 groups of 64 bytes (byte ``i`` of group ``t``: low nibble value
  ``8t + i % 4`` of block ``i // 4``, high nibble value ``8t + 4 + i % 4`` of the same block:
  one vector load, masked and shifted, gives two vectors of codes), then the bfloat16 scales
  of the chunk's groups, then their offsets: one of each per group of ``32 * per`` values
  (``per`` = 1, 2, 4 or 8: :func:`int4_blocks_per_scale`), which the kernel spreads over its
  lanes with a permute.  Groups of 128 (the default) make a chunk 256 + 16 bytes, 4.25 bits a
  weight, less than Q4_0's 4.5; groups of 32, 256 + 64 bytes (5 bits, Q4_1's size).  A last
  chunk of 8 blocks (256 values) is laid out the same with 32-byte groups of codes; widths are
  padded to a multiple of 256 with zero codes and scales.  The kernel reads ``per`` from the
  rows' length (:func:`int4_row_bytes` differs for each).  Models on the AVX-512 VNNI path hold
  a scale per group; on the AVX2 path, where the permutes cost more than the bytes save, per
  block of 32 (``per`` = 1: :func:`scale_per_group`).

Which kernel a model uses is the kernel policy's choice (``KernelPolicy.cpu_qkernel``:
``"avx512_vnni"``, ``"avx2"`` or None, from :class:`~llama.layers.cpu.CpuFeatures`); None,
or a machine with no C++ compiler, keeps torch's kernels.  The operators
(``torch.ops.llama_qcpu.q8_matmul`` / ``q4_matmul``) have fake kernels, so compiled steps
call them as they are.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Optional

import torch

from llama.runtime import host

logger = logging.getLogger(__name__)

BLOCK = 32
ISA_CODES = {"avx2": 1, "avx512_vnni": 2}
_SOURCE = Path(__file__).parent / "csrc" / "qmatmul.cpp"
_ready = False  # set by load(); read by the products (a plain flag: torch.compile guards on it)


def ready() -> bool:
    """Whether :func:`load` has made the kernels available in this process."""
    return _ready


def cache_dir() -> Path:
    """Where the built kernels are kept: ``$LLAMA_KERNEL_CACHE``, else
    ``~/.cache/llama/kernels``, a folder per torch version (a library built against one torch
    does not load into another)."""
    root = os.environ.get("LLAMA_KERNEL_CACHE") or os.path.join(Path.home(), ".cache", "llama", "kernels")
    return Path(root) / ("torch-" + torch.__version__.replace("+", "_"))


@functools.lru_cache(maxsize=None)
def load() -> bool:
    """Build (first use: about 20-40 s) or load the kernels; False, logged, where they cannot
    be built (no C++ compiler, or the build failed): torch's kernels are used then."""
    global _ready
    if host.cpp_compiler() is None:
        logger.info("no C++ compiler found: int8/int4 CPU products use torch's kernels")
        return False
    from torch.utils import cpp_extension  # imported here: it is slow to import

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("loading llama's int8/int4 CPU kernels (built once into %s)", build)
    try:
        cpp_extension.load(name="llama_qcpu", sources=[str(_SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                           extra_ldflags=["-fopenmp"],
                           build_directory=str(build), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as error:  # a failed build or load
        logger.warning("could not build llama's int8/int4 CPU kernels (%s): using torch's kernels", error)
        return False
    _register_fakes()
    _ready = True
    logger.info("int8/int4 CPU kernels ready in %.1f s", time.perf_counter() - started)
    return True


def int4_kernel_layout_expected() -> bool:
    """Whether an int4 model on this CPU will hold its matrices in our kernel's layout
    (``prepare_model_`` lays them out, in place of torch's packing, where the CPU has the
    kernel's instructions and a C++ compiler is found): what the memory check counts."""
    from llama.layers.cpu import CpuFeatures

    return CpuFeatures.probe().int8_dot is not None and host.cpp_compiler() is not None


def expected_scale_spacing(group_size: int) -> int:
    """The values one stored scale covers in the int4 layout this CPU's kernel path will hold
    (:func:`scale_per_group`): the group, or 32."""
    from llama.layers.cpu import CpuFeatures

    return group_size if scale_per_group(CpuFeatures.probe().int8_dot) else BLOCK


def _register_fakes() -> None:
    """Shapes for torch.compile: both products give (rows, output features) in float32."""

    def q8_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, isa: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[0])

    def q4_fake(x: torch.Tensor, w: torch.Tensor, k: int, isa: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[0])

    torch.library.register_fake("llama_qcpu::q8_matmul", q8_fake)
    torch.library.register_fake("llama_qcpu::q4_matmul", q4_fake)


def isa_code(isa: str) -> int:
    if isa not in ISA_CODES:
        raise ValueError(f"CPU kernel must be one of {sorted(ISA_CODES)}, got {isa!r}")
    return ISA_CODES[isa]


def _as_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels take it: 2-d, contiguous, float32 or bfloat16 (others as float32)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.float()
    return flat.contiguous()


def _as_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dtype in (torch.float32, torch.bfloat16) else scale.float()


def set_parallel_min_bytes(bytes_: int) -> int:
    """Products that read fewer weight bytes (times activation rows) than ``bytes_`` run on the
    calling thread alone, the rest split over torch's threads (512 KiB unless set: a small
    product loses more to handing work to a second thread than it gains; qmatmul.cpp says what
    was measured).  Returns the bound it replaces.  For benchmarks and tests: the results are
    the same either way (each output row is summed by one thread, in the same order)."""
    if bytes_ < 0:
        raise ValueError(f"set_parallel_min_bytes takes a number of bytes, 0 or more, got {bytes_}")
    if not load():
        raise RuntimeError("llama's int8/int4 CPU kernels are not available here (no C++ compiler, or their build "
                           "failed: see the log): there is no bound to set")
    return int(torch.ops.llama_qcpu.set_parallel_min_bytes(bytes_))


def q8_linear(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor, isa: str) -> torch.Tensor:
    """``x @ (weight_int8 * scale[:, None]).T`` through the int8 kernel (:func:`load` must have
    succeeded); the input width must be a multiple of 32.  Float32 sums; the result in ``x.dtype`` (float32 and bfloat16
    inputs are read as they are, and the result written in their dtype)."""
    flat = _as_input(x)
    out = torch.ops.llama_qcpu.q8_matmul(flat, weight_int8, _as_scale(scale), isa_code(isa))
    return out.to(x.dtype).view(*x.shape[:-1], weight_int8.shape[0])


def q4_linear(x: torch.Tensor, packed: torch.Tensor, in_features: int, isa: str) -> torch.Tensor:
    """``x @ W.T`` for W packed by :func:`pack_int4` (``in_features`` wide), through the int4
    kernel; the result in ``x.dtype``."""
    out = torch.ops.llama_qcpu.q4_matmul(_as_input(x), packed, in_features, isa_code(isa))
    return out.to(x.dtype).view(*x.shape[:-1], packed.shape[0])


# ---------------------------------------------------------------------------- the int4 layout


def padded_width(in_features: int) -> int:
    """The int4 layout's width: ``in_features`` up to a multiple of 256."""
    return -(-in_features // 256) * 256


def int4_blocks_per_scale(group_size: int) -> int:
    """How many blocks of 32 values one stored scale covers in the int4 layout for groups of
    ``group_size``: the largest of 1, 2, 4 and 8 that divides ``group_size / 32`` (a larger
    group's scale is stored once per 256 values)."""
    if group_size % BLOCK:
        raise ValueError(f"the int4 CPU kernel takes groups of a multiple of {BLOCK} values, got {group_size}")
    per = 8
    while (group_size // BLOCK) % per:
        per //= 2
    return per


def int4_row_bytes(in_features: int, group_size: int = BLOCK) -> int:
    """Bytes of one row in the int4 layout: per 512 values 256 of codes and 4 for each stored
    scale and offset (320 for groups of 32, 272 for groups of 128); half as many for a last 256."""
    width = padded_width(in_features)
    per = int4_blocks_per_scale(group_size)
    return width // 512 * (256 + 64 // per) + (128 + 32 // per if width % 512 else 0)


def holds_scale_per_group(packed: torch.Tensor, in_features: int) -> bool:
    """Whether rows in the int4 layout store a scale per group (``per_group`` of :func:`pack_int4`)
    rather than per block of 32 (the same for groups of 32)."""
    return _blocks_per_scale_of(packed, in_features) > 1


def _blocks_per_scale_of(packed: torch.Tensor, in_features: int) -> int:
    """``per`` of rows in the int4 layout, from their length (each ``per`` gives another)."""
    for per in (1, 2, 4, 8):
        if packed.shape[1] == int4_row_bytes(in_features, BLOCK * per):
            return per
    raise ValueError(f"rows of {packed.shape[1]} bytes are not the int4 layout of width {in_features}")


def _chunks(width: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each chunk of a padded width: 16 blocks, and 8 for a last 256."""
    blocks = width // BLOCK
    out = [(b, 16) for b in range(0, blocks - blocks % 16, 16)]
    if blocks % 16:
        out.append((blocks - 8, 8))
    return out


def scale_per_group(isa: Optional[str]) -> bool:
    """Whether int4 rows for the kernel path ``isa`` store a scale and an offset per group (of up
    to 256 values), not per block of 32.  Fewer bytes, but each chunk's scales are spread over
    the lanes by permutes: on AVX-512 VNNI a decoding step's products take 0.77-0.88x the time
    with groups of 64 or 128, on AVX2 1.1-1.2x (150m, AMD Zen 4, 1 and 2 threads): AVX2 keeps a
    scale per block."""
    return isa == "avx512_vnni"


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, per_group: bool = True) -> torch.Tensor:
    """(out, :func:`int4_row_bytes`) uint8: codes 0..15 (out, in), and per group (out, in /
    group) the bfloat16 scale and offset (``W = (q - 8) * scale + offset``; groups of a
    multiple of 32 values) in the kernel's layout (see the module's docstring), a scale and an
    offset per :func:`int4_blocks_per_scale` blocks, or (``per_group`` False) per block of 32."""
    out_features, in_features = codes.shape
    if in_features % BLOCK:
        raise ValueError(f"the int4 CPU kernel takes widths that are a multiple of {BLOCK}, got {in_features}")
    group = in_features // scale.shape[1]
    per = int4_blocks_per_scale(group)  # checks the group
    per = per if per_group else 1
    width = padded_width(in_features)
    q = torch.zeros(out_features, width, dtype=torch.uint8)
    q[:, :in_features] = codes.to(torch.uint8)
    per_block = width // BLOCK
    s = torch.zeros(out_features, per_block, dtype=torch.bfloat16)
    z = torch.zeros(out_features, per_block, dtype=torch.bfloat16)
    s[:, : in_features // BLOCK] = scale.to(torch.bfloat16).repeat_interleave(group // BLOCK, dim=1)
    z[:, : in_features // BLOCK] = zero.to(torch.bfloat16).repeat_interleave(group // BLOCK, dim=1)
    parts = []
    for first, blocks in _chunks(width):
        c = q[:, first * BLOCK : (first + blocks) * BLOCK].view(out_features, blocks, 4, 2, 4)  # row, block, t, half, j
        c = c.permute(0, 2, 3, 1, 4).reshape(out_features, 4, 2, blocks * 4)  # (row, t, low/high, byte i)
        nibbles = c[:, :, 0] | (c[:, :, 1] << 4)
        parts += [nibbles.reshape(out_features, -1), s[:, first : first + blocks : per].contiguous().view(torch.uint8),
                  z[:, first : first + blocks : per].contiguous().view(torch.uint8)]
    return torch.cat(parts, dim=1).contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4`: (codes 0..15 (out, in) uint8, scale and offset per
    block of 32 values (out, in / 32) bfloat16) of rows in the kernel's layout."""
    out_features = packed.shape[0]
    per = _blocks_per_scale_of(packed, in_features)
    width = padded_width(in_features)
    codes = torch.empty(out_features, width, dtype=torch.uint8)
    scale = torch.empty(out_features, width // BLOCK, dtype=torch.bfloat16)
    zero = torch.empty_like(scale)
    at = 0
    for first, blocks in _chunks(width):
        nibbles = packed[:, at : at + 16 * blocks].reshape(out_features, 4, 1, blocks * 4)  # (row, t, -, byte i)
        c = torch.cat([nibbles & 15, nibbles >> 4], dim=2).view(out_features, 4, 2, blocks, 4)  # row, t, half, block, j
        codes[:, first * BLOCK : (first + blocks) * BLOCK] = c.permute(0, 3, 1, 2, 4).reshape(out_features, -1)
        at += 16 * blocks
        stored = blocks // per
        for values, offset in ((scale, 0), (zero, 2 * stored)):
            raw = packed[:, at + offset : at + offset + 2 * stored].contiguous().view(torch.bfloat16)
            values[:, first : first + blocks] = raw.repeat_interleave(per, dim=1)
        at += 4 * stored
    return codes[:, :in_features], scale[:, : in_features // BLOCK], zero[:, : in_features // BLOCK]


def torch_int4_from_kernel_layout(packed: torch.Tensor, in_features: int, group_size: int,
                                  block_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """(``weight_int4``, ``weight_scales_and_zeros`` (in / group, rows, 2)) as
    :func:`llama.layers.quantize.int4_matrix` packs them for the CPU, from rows in our kernel's
    layout (the inverse of :func:`pack_int4_from_torch`, exactly): what an int4 layer that
    holds only the kernel's layout gives ``state_dict()``.  By blocks of ``block_rows`` rows (a
    multiple of torch's 64-row packing blocks) to keep the temporaries small."""
    if block_rows % _TORCH_INT4_BLOCK_ROWS:
        raise ValueError(f"block_rows must be a multiple of {_TORCH_INT4_BLOCK_ROWS}, got {block_rows}")
    parts, scales, zeros = [], [], []
    every = group_size // BLOCK  # a group's scale is each of its blocks'
    for start in range(0, packed.shape[0], block_rows):
        codes, scale, zero = unpack_int4(packed[start : start + block_rows], in_features)
        parts.append(torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2))
        scales.append(scale[:, ::every])
        zeros.append(zero[:, ::every])
    weight_int4 = parts[0] if len(parts) == 1 else torch.cat(parts)
    scales_and_zeros = torch.stack([torch.cat(scales), torch.cat(zeros)], dim=-1).transpose(0, 1).contiguous()
    return weight_int4, scales_and_zeros


# ---------------------------------------------------------------------------- pure-torch twins


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (rows, in) as float, scale per block (rows, in / 32)) of a 2-d float input:
    Q8_0's quantisation, ``round(x / d)``, ``d = max|x| / 127`` per block of 32."""
    rows, width = x.shape
    blocks = x.float().reshape(rows, width // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127)
    return codes.reshape(rows, width), d


def q8_block_index(width: int) -> torch.Tensor:
    """The activation block of each of ``width`` values in the int8 kernel: the kernel reads a
    weight row as it is, 64 values a vector, and each 32-bit lane of 4 values sums over up to
    8 vectors before it scales, so a block is what one lane sees -- block ``l`` of a group of
    512 values holds values ``64c + 4l + j`` (``c < 8``, ``j < 4``); a last group of fewer vectors
    has blocks of 4 values a vector, and a last 32 values (widths of 64n + 32) are one block."""
    k = torch.arange(width)
    index = (k // 512) * 16 + (k % 64) // 4
    whole = width // 64 * 64
    if whole < width:
        index[whole:] = 16 * (-(-(width // 64) // 8))
    return index


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, each value's block scale), both (rows, in) float32, of a 2-d input as the int8
    kernel quantises it: ``round(x / d)``, ``d = max|x| / 127`` over the blocks of
    :func:`q8_block_index` (32 values each, as Q8_0's, but strided)."""
    rows, width = x.shape
    index = q8_block_index(width)
    blocks = int(index.max()) + 1
    magnitude = x.float().abs()
    amax = torch.zeros(rows, blocks).scatter_reduce(1, index.expand(rows, width), magnitude, "amax")
    d = amax / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(x.float() * inv[:, index]).clamp(-127, 127)
    return codes, d[:, index]


def q8_reference(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What :func:`q8_linear` computes, in torch (float64): the activations quantised as the
    kernel does (:func:`quantize_activations_int8`) times the int8 weight, times the row's scale."""
    flat = x.reshape(-1, x.shape[-1])
    codes, d = quantize_activations_int8(flat)
    out = ((codes.double() * d.double()) @ weight_int8.double().t()) * scale.double()
    return out.to(x.dtype).view(*x.shape[:-1], weight_int8.shape[0])


def q4_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """What :func:`q4_linear` computes, in torch, from the unpacked codes (out, in) and the
    groups' scales and offsets (out, in / group)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    xq, d = quantize_activations(flat)
    rows, width = flat.shape
    group = width // scale.shape[1]
    s = scale.float().repeat_interleave(group // BLOCK, dim=1)  # per block
    z = zero.float().repeat_interleave(group // BLOCK, dim=1)
    xb = xq.reshape(rows, -1, BLOCK)
    sums = torch.einsum("rbk,nbk->rnb", xb, codes.float().reshape(codes.shape[0], -1, BLOCK))
    out = (sums * s * d.unsqueeze(1) + (z - 8 * s) * (d * xb.sum(-1)).unsqueeze(1)).sum(-1)
    return out.to(x.dtype).view(*x.shape[:-1], codes.shape[0])




# ---------------------------------------------------------------------------- from torch's int4 layout

# torch's CPU int4 packing lays rows out in blocks of 64 (llama.layers.quantize packs by
# blocks of a multiple of 64 rows), with a different order for a last block of fewer rows.
_TORCH_INT4_BLOCK_ROWS = 64


def _torch_int4_order(rows: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte of torch's CPU int4 packing of a (rows, in) matrix, the flat index
    (row * in + column) of the code in its low nibble and in its high nibble: found by packing
    the rows' and columns' digits in base 16 (torch's layout is not documented)."""
    n = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, in_features)
    k = torch.arange(in_features, dtype=torch.int32)[None, :].expand(rows, in_features)
    low = torch.zeros(rows, in_features // 2, dtype=torch.int64)
    high = torch.zeros_like(low)
    for index, radix in ((n, in_features), (k, 1)):
        digit, place = 0, 1
        while place <= int(index.max()) or digit == 0:
            packed = torch._convert_weight_to_int4pack_for_cpu(((index // place) % 16).contiguous(), 2).long()
            low += (packed & 15) * place * radix
            high += (packed >> 4) * place * radix
            place *= 16
            digit += 1
    return low.flatten(), high.flatten()


@functools.lru_cache(maxsize=8)
def _torch_int4_source(rows: int, in_features: int) -> torch.Tensor:
    """For each code (row * in + column) of a (rows, in) block, the nibble holding it in torch's
    CPU int4 packing: ``2 * byte`` for a low nibble, ``2 * byte + 1`` for a high one."""
    low, high = _torch_int4_order(rows, in_features)
    source = torch.empty(rows * in_features, dtype=torch.int64)
    bytes_ = torch.arange(low.numel())
    source[low] = 2 * bytes_
    source[high] = 2 * bytes_ + 1
    return source


def codes_from_torch_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The codes 0..15 (rows, in) as uint8 of a matrix packed by torch's CPU int4 packing
    (``torch._convert_weight_to_int4pack_for_cpu``, as :func:`llama.layers.quantize.int4_matrix`
    packs on the CPU), exactly."""
    rows = packed.shape[0]
    codes = torch.empty(rows * in_features, dtype=torch.uint8)
    flat = packed.reshape(-1)
    whole = rows // _TORCH_INT4_BLOCK_ROWS
    tail = rows - whole * _TORCH_INT4_BLOCK_ROWS
    # (first row, rows a block, blocks): the whole blocks of 64 rows, then the rest as one
    for first, block_rows, count in ((0, _TORCH_INT4_BLOCK_ROWS, whole), (whole * _TORCH_INT4_BLOCK_ROWS, tail, 1)):
        if count == 0 or block_rows == 0:
            continue
        source = _torch_int4_source(block_rows, in_features)
        size = block_rows * in_features
        start = first * in_features  # in codes; bytes are half
        part = flat[start // 2 : (start + count * size) // 2].view(count, size // 2)
        nibbles = torch.stack([part & 15, part >> 4], dim=-1).view(count, size)  # byte i: 2i low, 2i + 1 high
        torch.index_select(nibbles, 1, source, out=codes[start : start + count * size].view(count, size))
    return codes.view(rows, in_features)


def pack_int4_from_torch(packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int,
                         block_rows: int = 8192, per_group: bool = True) -> torch.Tensor:
    """An int4 layer's matrix as torch packs it for the CPU (``weight_int4``, and
    ``weight_scales_and_zeros`` (in / group, rows, 2)) in our kernel's layout (:func:`pack_int4`),
    by blocks of ``block_rows`` rows (a multiple of 64) to keep the temporaries small;
    ``per_group``: as :func:`pack_int4`'s."""
    rows = packed.shape[0]
    parts = []
    for start in range(0, rows, block_rows):
        end = min(rows, start + block_rows)
        codes = codes_from_torch_int4(packed[start:end], in_features)
        scale = scales_and_zeros[:, start:end, 0].t()
        zero = scales_and_zeros[:, start:end, 1].t()
        parts.append(pack_int4(codes, scale, zero, per_group))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
