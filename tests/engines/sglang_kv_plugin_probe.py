"""Run as a script in a fresh process (test_sglang_kv_backend.py): SGLang's own plug-in loader
registers the moecomm transfer backend from an installed entry point, without anyone calling
``register()``.

The entry point is moecomm's (``[project.entry-points."sglang.srt.plugins"]`` in pyproject.toml),
written into a throwaway ``.dist-info`` folder on ``sys.path`` (argv[1]) exactly as pip writes it
at install, so the check does not depend on when the checkout was last reinstalled. Prints one
JSON line: what SGLang resolved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import engine_env
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def main(folder: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    group = "sglang.srt.plugins"
    entry = project["entry-points"][group]
    info = Path(folder) / "moecomm_plugin_probe-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    meta = "Metadata-Version: 2.1\nName: moecomm-plugin-probe\nVersion: 0\n"
    (info / "METADATA").write_text(meta)
    lines = [f"[{group}]"] + [f"{name} = {target}" for name, target in entry.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, folder)
    engine_env.activate()

    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins import load_plugins

    before = "moecomm" in DISAGG_TRANSFER_BACKEND_CHOICES
    load_plugins()
    backend = TransferBackend("moecomm")
    print(
        json.dumps(
            {
                "entry": entry,
                "choice_before": before,
                "choice_after": "moecomm" in DISAGG_TRANSFER_BACKEND_CHOICES,
                "member": backend.name,
                "prefill_sender": prefill.get_kv_class(backend, KVClassType.SENDER).__qualname__,
                "decode_receiver": decode.get_kv_class(backend, KVClassType.RECEIVER).__qualname__,
                "nixl_manager": prefill.get_kv_class(
                    TransferBackend.NIXL, KVClassType.MANAGER
                ).__qualname__,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
