"""Write precompile/servers/sglang/flags.json: every option of sglang's server parser, from the installed wheel.

Regenerate for a new sglang release (and commit the result with the room's ``VERSION`` moved to it;
tests/test_sglang_oracle.py checks that the committed table is what the installed wheel's parser gives)::

    pip install --no-deps --target /tmp/sgl sglang==<version> <the packages in tests/sglang_wheel.py>
    PYTHONPATH=/tmp/sgl python bench/gen_sglang_flags.py            # or --check to compare only

The table is what jitwarm's built-in argv parser (``jitwarm.precompile.servers.sglang.argv``) reads: for each
option string (aliases included) its value count (0, 1, "?", "*", "+"), its dest and, for flags, the value
it stores; and whether the parser accepts unique prefixes (argparse's ``allow_abbrev``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # sglang's own parser, called, is a test helper: tests/sglang_parser_oracle.py

import sglang_parser_oracle  # noqa: E402

TABLE = ROOT / "precompile" / "servers" / "sglang" / "flags.json"


def render(table: dict) -> str:
    """The table as committed: one option per line, so a new release's diff reads option by option."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in table.items() if k != "options"]
    options = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in table["options"].items()]
    return "{\n" + "\n".join(lines) + '\n  "options": {\n' + ",\n".join(options) + "\n  }\n}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed table is stale")
    args = parser.parse_args()
    if sglang_parser_oracle.installed_version() is None:
        print("sglang is not installed", file=sys.stderr)
        return 2
    text = render(sglang_parser_oracle.flag_table())
    if args.check:
        stale = not TABLE.exists() or TABLE.read_text(encoding="utf-8") != text
        print(f"{TABLE}: {'stale' if stale else 'up to date'}")
        return int(stale)
    TABLE.write_text(text, encoding="utf-8")
    table = json.loads(text)
    print(f"wrote {TABLE}: {len(table['options'])} options of sglang {table['sglang']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
