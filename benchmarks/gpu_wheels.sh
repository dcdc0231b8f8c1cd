#!/usr/bin/env bash
# benchmarks/gpu_wheels.sh DIR: the wheels that benchmarks/gpu_check.py needs on a GPU machine
# without network (CPython 3.12, manylinux x86_64), gathered here into DIR.
#
#   bash benchmarks/gpu_wheels.sh .whl          # here, with network (.whl/ is git-ignored)
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD            # there, before python benchmarks/gpu_check.py
#
# What DIR holds: one wheel of every runtime dependency of the library except torch
# (requirements.txt's packages and what they need in turn), at the versions requirements.txt
# pins or, where it pins none, those its tests run with here, and llama-models==0.3.0 (the GPU
# checks take Meta's Llama 3 tokenizer.model from it).  fairscale has no wheel on the registry:
# its wheel is built from the source release (pure Python, py3-none-any).
#
# What it leaves out, on purpose:
#   - torch and what torch itself requires (typing-extensions, sympy, mpmath, networkx, jinja2,
#     markupsafe, filelock, fsspec, setuptools, triton, nvidia-*, cuda-*): the GPU machine's
#     torch brings its own, and copies installed with --target, first on PYTHONPATH, would
#     shadow them.  pydantic and pydantic-core need typing-extensions >= 4.14.1 from it.
#   - requests (tiktoken's, with charset-normalizer, urllib3, certifi): tiktoken imports it only
#     to download a rank file from a URL; the library builds tiktoken.Encoding from the
#     tokenizer.model it reads itself.
#   - llama-models' own requirements (httpx, huggingface-hub, pyyaml, rich, jinja2):
#     `import llama_models` imports none of them, and the GPU checks only read a file from it.
#   - optional imports that the packages fall back without (orjson for fastapi, sniffio for
#     anyio, uvloop/httptools/websockets for uvicorn).
#   - the benchmarks' own client (httpx, for gpu_check's serve part): the GPU image has it.
# After downloading, every wheel's requirements (markers read for CPython 3.12 on Linux) are
# checked against this list: one that is neither here nor left out above by name fails the run.
#
# llguidance 1.9.1 ships only manylinux_2_31 wheels: the GPU machine needs glibc >= 2.31
# (Ubuntu 24.04, whose Python is 3.12.3, has 2.39).
#
# PYTHON (default python3) is the interpreter whose pip downloads; any Python >= 3.8 with pip.
set -euo pipefail

if [[ $# -ne 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu_wheels.sh DIR   (DIR receives the wheels, e.g. .whl)" >&2
    exit 2
fi
DIR=$1
PYTHON=${PYTHON:-python3}

# name==version, one per package.  Versions: requirements.txt's pins (fairscale, llguidance, pillow),
# otherwise the ones installed with requirements-test.txt where the tests run.
PINS=(
    fairscale==0.4.13          # built from source: model-parallel layers
    numpy==2.4.6               # fairscale's; llama.structured's token masks
    sentencepiece==0.2.3       # Llama 2's tokenizer
    tiktoken==0.14.0           # Llama 3's and 4's tokenizer
    regex==2026.5.9            # tiktoken's
    fire==0.7.1                # the example scripts' and benchmarks' command lines
    termcolor==3.3.0           # fire's
    safetensors==0.8.0         # checkpoints in safetensors
    ninja==1.13.2              # builds the CPU int8/int4 kernels (llama/layers/csrc) on first use
    pillow==13.0.0             # images (llama.images)
    llguidance==1.9.1          # structured output (llama.structured)
    fastapi==0.165.0           # the server (llama.serve)
    annotated-doc==0.0.7       # fastapi's
    opentelemetry-api==1.45.2  # fastapi's (imported by fastapi.applications)
    starlette==1.10.0          # fastapi's, sse-starlette's
    anyio==4.16.0              # starlette's
    idna==3.20                 # anyio's
    pydantic==2.13.4           # the server's request models
    pydantic-core==2.46.4      # pydantic's (it pins this exact version)
    annotated-types==0.7.0     # pydantic's
    typing-inspection==0.4.2   # pydantic's, fastapi's
    uvicorn==0.54.0            # the server's HTTP
    click==8.5.1               # uvicorn's
    h11==0.16.0                # uvicorn's
    sse-starlette==3.7.0       # streamed responses
    prometheus-client==0.26.0  # /metrics
    llama-models==0.3.0        # Meta's Llama 3 tokenizer.model for the GPU checks
)
BUILT=(fairscale)  # no wheel on the registry: `pip wheel --no-deps` from the source release
# Left out (see above): required by a wheel here, provided or not reached there.
PROVIDED="torch typing-extensions sympy mpmath networkx jinja2 markupsafe filelock fsspec setuptools triton"
NOT_REACHED="requests httpx huggingface-hub pyyaml rich"
PLATFORMS=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
    echo "gpu_wheels.sh: '$PYTHON -m pip' does not run: set PYTHON to an interpreter with pip" >&2
    exit 1
fi
mkdir -p "$DIR"
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT

for pin in "${PINS[@]}"; do
    name=${pin%%==*}
    log="$STAGE/$name.log"
    if [[ " ${BUILT[*]} " == *" $name "* ]]; then
        what="build a wheel of"
        cmd=("$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$STAGE/wheels" "$pin")
    else
        what="download a CPython 3.12 manylinux x86_64 wheel of"
        cmd=("$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
             --implementation cp "${PLATFORMS[@]}" --dest "$STAGE/wheels" "$pin")
    fi
    if ! "${cmd[@]}" >"$log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 15 >&2 || true
        echo "gpu_wheels.sh: could not $what $pin (pip's messages above); check the network and that" \
             "$pin exists for CPython 3.12 on manylinux x86_64, then run it again. $DIR is unchanged." >&2
        exit 1
    fi
done

# One wheel per pin, each installable on CPython 3.12 / x86_64 Linux, and every requirement of
# every wheel either here (at a version it accepts) or left out by name above.
"$PYTHON" - "$STAGE/wheels" "$PROVIDED" "$NOT_REACHED" "${PINS[@]}" <<'EOF'
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

wheel_dir, provided, not_reached, pins = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split(), sys.argv[4:]
left_out = {canonicalize_name(n) for n in provided + not_reached}
want = {canonicalize_name(p.split("==")[0]): p.split("==")[1] for p in pins}
env = dict(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
           platform_python_implementation="CPython", implementation_version="3.12.3", sys_platform="linux",
           platform_system="Linux", platform_machine="x86_64", os_name="posix", extra="")
problems, have = [], {}
for whl in sorted(wheel_dir.glob("*.whl")):
    name, version, _, tags = parse_wheel_filename(whl.name)
    if name in have:
        problems.append(f"two wheels of {name}: {have[name][0].name} and {whl.name}")
    have[name] = (whl, str(version))
    if not any((t.interpreter in ("py3", "cp312") or re.fullmatch(r"cp3(\d+)", t.interpreter) and t.abi == "abi3"
                and int(t.interpreter[3:]) <= 12) and (t.platform == "any" or t.platform.endswith("x86_64"))
               for t in tags):
        problems.append(f"{whl.name} does not install on CPython 3.12 x86_64")
for name, version in want.items():
    if name not in have:
        problems.append(f"no wheel of {name}=={version} came down")
    elif have[name][1] != version:
        problems.append(f"{have[name][0].name} is not version {version}")
for name, (whl, _) in have.items():
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8").splitlines()
    for line in lines:
        if not line:
            break  # end of the headers
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        if dep in left_out:
            continue
        if dep not in have:
            problems.append(f"{name} requires {req}, which is neither among the wheels nor left out by name: "
                            f"add it to PINS (or to NOT_REACHED, with the reason) in benchmarks/gpu_wheels.sh")
        elif not req.specifier.contains(have[dep][1], prereleases=True):
            problems.append(f"{name} requires {req}, but the wheel is {dep} {have[dep][1]}")
if problems:
    sys.exit("gpu_wheels.sh: the wheels do not fit together:\n  " + "\n  ".join(problems))
EOF

rm -f "$DIR"/*.whl
mv "$STAGE"/wheels/*.whl "$DIR"/
ls -l "$DIR"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
total=$(cat "$DIR"/*.whl | wc -c)
echo "gpu_wheels.sh: ${#PINS[@]} wheels in $DIR, $(( (total + 524288) / 1048576 )) MiB ($total bytes)"
