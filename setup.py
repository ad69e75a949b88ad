"""The native modules, built by `pip install -e .` (scripts/setup_env.sh); the rest is in
pyproject.toml. They need gcc, the Python headers and Debian's libxxhash-dev (header only)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstrata.cache._chainhash",
            ["kvstrata/cache/_chainhash.c"],
            extra_compile_args=["-O3"],
        ),
        # decode attention over the paged pool; fast-math lets expf vectorize (libmvec),
        # infinities stay meaningful (the running max starts at -inf)
        Extension(
            "kvstrata.model._paged_decode",
            ["kvstrata/model/_paged_decode.c"],
            extra_compile_args=["-O3", "-ffast-math", "-fno-finite-math-only", "-pthread"],
            extra_link_args=["-pthread", "-lm"],
        ),
    ]
)
