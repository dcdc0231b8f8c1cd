from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="llama",
    version="0.1.0",
    description="Model-parallel inference for Meta's Llama 2 and Llama 3.x checkpoints",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["llama", "llama.*"]),
    python_requires=">=3.10",
    # torch is pinned in requirements.txt, not here, so CUDA users keep their own build.
    # llguidance: the grammar engine of structured output (llama.structured).
    install_requires=["torch>=2.11", "fairscale", "sentencepiece", "tiktoken", "fire", "safetensors", "ninja",
                      "llguidance==1.9.1", "Pillow==13.0.0"],
    # The server (llama.serve, the llama-serve command): pip install 'llama[serve]'.
    extras_require={
        "serve": ["fastapi>=0.110,<1", "uvicorn>=0.29,<1", "pydantic>=2.6,<3", "sse-starlette>=2.1,<4",
                  "prometheus_client>=0.20,<1"],
    },
    # llama.layers.csrc: the C++ source of the CPU int8/int4 kernels, built on first use.
    package_data={"llama.serve": ["static/*.html"], "llama.layers": ["csrc/*.cpp"]},
    entry_points={"console_scripts": ["llama-serve=llama.serve:cli"]},
)
