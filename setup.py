# SPDX-License-Identifier: Apache-2.0
from setuptools import find_packages, setup

setup(
    name="nextn-runtime",
    version="0.1.0",
    description="An LLM serving runtime with MTP (NextN) speculative decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["runtime", "runtime.*"]),
    package_data={"runtime": ["assets/**/*", "kernels/csrc/*.cpp"]},
    include_package_data=True,
    install_requires=[
        # torch is installed first by .ci/run (CPU build on disk); any recent release works.
        "torch>=2.7",
        "transformers>=5.23.0,<6",
        "tokenizers>=0.22",
        "safetensors>=0.5",
        "tqdm>=4.66",
        "numpy>=1.26",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "prometheus-client>=0.20",
        "pydantic>=2",
        "jinja2>=3.1",  # chat templates (transformers renders them with it)
        # structured output (json_schema / regex / ebnf); CPU wheels, as SGLang and vLLM use
        "xgrammar>=0.1.25",
        # builds the CPU narrow-weight kernel on first use (torch.utils.cpp_extension)
        "ninja>=1.11",
    ],
    extras_require={
        "test": [
            # The oracle: this exact release ships deepseek_v4 and qwen4_exp.
            "transformers==5.23.0",
            "pytest>=8",
            "scipy>=1.11",
            "openai>=1.30",
            "requests>=2.31",
            "matplotlib>=3.7",
            "jsonschema>=4",
            # the Triton kernels run on CPU tensors through its interpreter in the tests
            # (TRITON_INTERPRET=1); on CUDA torch brings its own
            'triton==3.9.0; platform_system=="Linux" and platform_machine=="x86_64"',
        ],
        # the Triton CUDA kernels (runtime/kernels/triton/, quantized_triton.py); on CUDA
        # torch brings it, and without it the torch references serve
        "triton": ["triton>=3.0"],
    },
    entry_points={"console_scripts": ["launch_server=runtime.launch_server:main"]},
)
