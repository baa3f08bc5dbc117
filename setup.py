"""Packaging for megatron_lossfix: exact, layout-invariant loss normalization for Megatron-Core."""

import re
from glob import glob

from setuptools import find_packages, setup

# The one place the version is written: megatron_lossfix/__init__.py.
with open("megatron_lossfix/__init__.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)

setup(
    name="megatron_lossfix",
    version=VERSION,
    license="Apache-2.0",
    description=(
        "Exact global loss normalization for Megatron-Core: the same gradient under any "
        "micro-batch size and TP/PP/DP/CP/EP layout, for SFT and RL losses."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # Tested on Python 3.11 (megatron-core 0.16.x) and 3.12 (0.17 and newer need Python >= 3.12).
    python_requires=">=3.11",
    # The runtime and its subpackages only: tests/ and examples/ stay in the repository.
    packages=find_packages(include=["megatron_lossfix", "megatron_lossfix.*"]),
    # What `python -m megatron_lossfix install-bridge` installs beside Megatron Bridge.
    package_data={"megatron_lossfix.integrations.bridge.adapter": ["requirements.txt"]},
    # Megatron-LM patches (python -m megatron_lossfix.patches): the repository's patches/ is the
    # only copy; a non-editable install puts them under <prefix>/share/megatron_lossfix/patches.
    data_files=[("share/megatron_lossfix/patches", sorted(glob("patches/*.patch")))],
    install_requires=[
        "torch>=2.6",
        "packaging",
        # Proven by the suite on 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (noxfile.py), and on 0.20.0
        # (Megatron-LM main, not on the index) in the NeMo-RL page's environment (docs/releases.md);
        # a release outside this range warns at run time (megatron_compat.warn_if_untested).
        "megatron-core>=0.16,<0.21",
    ],
    extras_require={
        # Test-only tools; the suite runs on CPU with gloo, one pytest-xdist worker per core.
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "ruff==0.17.6",
            "matplotlib>=3.8",
        ],
        # What Megatron-LM's training scripts (pretrain_gpt.py, train_rl.py: megatron/training,
        # megatron/rl, megatron/inference) import beyond megatron-core; at core_v0.16.1 its
        # chat templates import transformers besides (docs/megatron_lm_rl.md).
        "megatron-lm": [
            "six",
            "regex",
            "pyyaml",
            "pydantic",
            "pybind11",
            "psutil",
            "einops",
            "tensorboard",
            "wandb",
            "httpx",
            "fastapi",
            "uvicorn",
            "openai",
            "tqdm",
        ],
        # Transformer Engine needs CUDA; it is used when present, never required.
        # (NVIDIA Apex is built from source; the PyPI package named `apex` is unrelated.)
        "te": ["transformer_engine[pytorch]"],
        # SkyRL's Megatron path on a CPU machine: skyrl itself (no extras: its megatron and
        # skyrl-train extras pin flash-attn, Transformer Engine and vllm, which need CUDA) and the
        # modules its Megatron model wrapper imports (megatron_model_wrapper -> skyrl.train,
        # skyrl_gym, ray's registry). Its megatron.bridge import is provided by the stack audit
        # (see docs/skyrl.md).
        "skyrl": [
            "skyrl==0.4.0",
            "skyrl-gym==0.4.0",
            "ray==2.57.0",
            "omegaconf",
            "loguru",
            "jaxtyping",
            "pydantic",
        ],
        # verl at the release the stack audit and the adapter are measured with; its own
        # requirements need no GPU. (CI runs docs/verl.md's install line as printed.)
        "verl": ["verl==0.9.1"],
        # What slime's Megatron loss path (backends/megatron_utils: loss, cp_utils, data, model,
        # and the modules they import: utils/http_utils, utils/memory_utils, observability)
        # imports on CPU beside torch and megatron-core, and no more. slime is not on the
        # package index: it is installed from its source without dependencies beside this
        # extra (docs/slime.md; CI runs that page's line in a fresh virtualenv).
        "slime": ["httpx", "packaging", "psutil", "tqdm", "wandb"],
        # AReaL's Megatron loss path (areal/engine/megatron_engine.py, trainer/ppo/actor.py and
        # what they import) beside torch and megatron-core, at AReaL's own pins. areal itself
        # and mbridge install without dependencies beside this extra (AReaL's own requirements
        # include agent frameworks and GPU-only packages the loss path never imports); Megatron
        # Bridge, which imports Transformer Engine, is provided by the stack audit (docs/areal.md).
        "areal": [
            "transformers>=5.0.0,<=5.3.0",
            "hydra-core==1.4.0.dev1",
            "omegaconf==2.4.0.dev2",
            "swanlab==0.6.12",
            "aiohttp>=3.13.3,<4",
            "httpx>=0.28.1",
            "uvloop>=0.21.0",
            "tenacity>=8.2.0",
            "pillow>=12.1.1",
            "datasets>=3.0.0",
            "aiofiles",
            "colorlog",
            "einops",
            "flask",
            "lark",
            "numba",
            "openai",
            "orjson",
            "pybase64",
            "pyyaml",
            "ray",
            "safetensors",
            "tabulate",
            "tensorboardx",
            "torchdata",
            "trackio",
            "wandb",
        ],
        # What ROLL's Megatron strategy, its RLVR actor and DPO worker (roll/distributed/strategy/
        # megatron_strategy.py, roll/pipeline/{rlvr,dpo}/actor_worker.py) and mcore_adapter import
        # on CPU beside torch and megatron-core (no vLLM, Transformer Engine or flash-attn).
        # ROLL is not on the package index (the index's `roll` and `mcore-adapter` are unrelated
        # projects): its mcore_adapter/ and its tree install from its source without dependencies
        # beside this extra (docs/roll.md; CI runs that page's line in a fresh virtualenv).
        "roll": [
            "transformers>=4.50.0",
            "accelerate>=0.27.2",
            "ray",
            "tensordict>=0.10.0",
            "omegaconf",
            "peft",
            "codetiming",
            "more_itertools",
            "pillow",
            "imageio",
            "modelscope",
            "pybase64",
            "opentelemetry-exporter-otlp",
            "TransferQueue==0.1.6",
        ],
        # ms-swift's Megatron trainers (swift/megatron/trainers/) at the release the stack audit
        # and the adapter are measured with, and the Megatron bridge ms-swift pins for it.
        # ms-swift imports msgspec without declaring it. mcore_bridge imports Transformer
        # Engine, which needs CUDA: the adapter's CPU module provides stand-ins
        # (docs/ms_swift.md).
        "ms-swift": ["ms-swift==4.6.0", "mcore-bridge==1.6.5", "msgspec"],
        # NeMo-RL's Megatron loss path (its policy worker's train(), nemo_rl/models/megatron and
        # what they import) beside torch and megatron-core, and the build tools that
        # `python -m megatron_lossfix install-nemo-rl` installs its three sources with (NeMo-RL,
        # Megatron Bridge, Megatron-LM's megatron/core: none is on the package index at
        # NeMo-RL's pins; docs/nemo_rl.md). Never Transformer Engine, vLLM or flash-attn.
        "nemo-rl": [
            "setuptools>=78.1.1,<80",
            "wheel",
            "pydantic",
            "transformers>=5.8,<5.9",
            "hydra-core",
            "omegaconf",
            "ray",
            "nvidia-ml-py",
            "mlflow-skinny",
            "tensordict",
            "datasets",
            "swanlab",
            "wandb",
            "pillow",
            "pyzmq",
            "matplotlib",
            "ipython",
            "tensorboard",
            "prometheus_client",
        ],
        # The documentation site: `mkdocs build --strict` (docs/, mkdocs.yml).
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26"],
    },
    entry_points={
        "console_scripts": ["megatron-lossfix=megatron_lossfix.__main__:main"],
        # verl loads its plugins when it is imported; the adapter acts only when switched on.
        "verl.plugins": ["megatron_lossfix=megatron_lossfix.integrations.verl.adapter"],
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
