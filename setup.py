"""The one native module, built by `pip install -e .` (scripts/setup_env.sh); the rest is in
pyproject.toml. It needs gcc, the Python headers and Debian's libxxhash-dev (header only)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstrata.cache._chainhash",
            ["kvstrata/cache/_chainhash.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
