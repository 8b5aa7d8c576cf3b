"""Packaging for jitwarm: three top-level folders installed under the ``jitwarm`` namespace."""
import ast
from pathlib import Path

from setuptools import setup

ROOTS = {
    "jitwarm": "jitwarm",  # a namespace holding only __main__.py: `python -m jitwarm`
    "jitwarm.precompile": "precompile",
    "jitwarm.kernels": "kernels",
    "jitwarm.cache": "cache",
}
# Each server and JIT library is a subpackage of its layer (precompile/servers/sglang, kernels/libraries/triton):
# list every folder with an __init__.py, so a new room needs no edit here.
PACKAGES = dict(ROOTS)
for name, folder in ROOTS.items():
    for init in sorted(Path(folder).glob("*/**/__init__.py")):
        sub = init.parent.relative_to(folder)
        PACKAGES[".".join((name, *sub.parts))] = str(init.parent)


def server_plugins() -> dict[str, list[str]]:
    """Each server room's plugin entry point, read from its ``__init__.py`` (``PLUGIN_GROUP``, ``PLUGIN``).

    Read, not imported: a new room (a folder under precompile/servers) needs no edit here.
    """
    found: dict[str, list[str]] = {}
    for init in sorted(Path("precompile/servers").glob("*/__init__.py")):
        constants = {target.id: node.value.value for node in ast.parse(init.read_text(encoding="utf-8")).body
                     if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                     for target in node.targets if isinstance(target, ast.Name)}
        if "PLUGIN_GROUP" in constants:
            found.setdefault(constants["PLUGIN_GROUP"], []).append(f"jitwarm = {constants['PLUGIN']}")
    return found


setup(
    name="jitwarm",
    version="0.1.0",
    description="JIT-kernel warmup and precompile service for CUDA-graph capture in LLM servers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={"jitwarm.kernels": ["csrc/*"], "jitwarm.precompile.servers.sglang": ["flags.json"]},
    include_package_data=True,
    # Each floor is a version the tests run against (.ci/run's floor pass installs exactly these), and low
    # enough to install beside sglang 0.5.23 and vLLM 0.33.0: both pin apache-tvm-ffi==0.1.11, and the torch
    # they pin (2.14.1, 2.14.0) pins triton~=3.8.0. filelock < 3.30 ignores KeyLock's preserve_lock_file.
    install_requires=[
        "torch>=2.13,<3",
        "apache-tvm-ffi>=0.1.11,<0.2",
        "triton>=3.8,<4",
        "filelock>=3.30,<5",
        "redis>=5.0,<9",
        "numpy>=1.26",
        "tomli>=2.0; python_version < '3.11'",
    ],
    # s3: the object-store tier (--remote s3://...; docs/cache.md, "Object-store tier"): boto3 1.36 has
    # PutObject's If-None-Match and If-Match. moto[server] is the S3 server the tests run on loopback.
    # pytest-xdist: the README's test command runs two workers (tests/conftest.py builds session caches once).
    # pyyaml: tests/test_docs_yaml.py parses the docs' Kubernetes manifests.
    extras_require={"s3": ["boto3>=1.36"],
                    "test": ["pytest>=8", "pytest-xdist>=3.5", "boto3>=1.36", "moto[server]>=5.0", "pyyaml>=6.0"]},
    entry_points={"console_scripts": ["jitwarm = jitwarm.precompile.cli:main"], **server_plugins()},
)
