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
        # infinities stay meaningful (the running max starts at -inf); OpenMP resolves to
        # torch's own libgomp when torch is loaded first
        Extension(
            "kvstrata.model._paged_decode",
            ["kvstrata/model/_paged_decode.c"],
            depends=["kvstrata/model/_vec_exp.h"],  # its vector exp
            extra_compile_args=["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp"],
            extra_link_args=["-fopenmp", "-lm"],
        ),
        # the exp pass of prefill attention's softmax; OpenMP as above
        Extension(
            "kvstrata.model._causal_softmax",
            ["kvstrata/model/_causal_softmax.c"],
            depends=["kvstrata/model/_vec_exp.h"],  # its vector exp
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp", "-lm"],
        ),
        # decode-sized linears; OpenMP resolves to torch's own libgomp when torch is loaded
        Extension(
            "kvstrata.model._small_matmul",
            ["kvstrata/model/_small_matmul.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ),
        # a decode step's small per-row ops (norm, rotary + KV write, argmax); omp simd only
        Extension(
            "kvstrata.model._step_ops",
            ["kvstrata/model/_step_ops.c"],
            extra_compile_args=["-O3", "-fopenmp-simd", "-ffp-contract=off"],
            extra_link_args=["-lm"],
        ),
    ]
)
