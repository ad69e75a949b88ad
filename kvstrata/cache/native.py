"""The compiled helpers of the cache's hot paths (`_chainhash.c`), with a clear error when the
module was not built. Built by `pip install -e .` (scripts/setup_env.sh does it), which needs
gcc, the Python headers and Debian's libxxhash-dev."""

from __future__ import annotations

try:
    from kvstrata.cache._chainhash import chain_keys as native_chain_keys
    from kvstrata.cache._chainhash import token_walk
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "kvstrata's native module kvstrata.cache._chainhash is not built: run "
        "`bash scripts/setup_env.sh` (it installs libxxhash-dev and compiles it with "
        f"`pip install -e .`); import said: {e}"
    ) from e

__all__ = ["native_chain_keys", "token_walk"]
