"""Print one of the README's two commands, exactly as written there, so CI runs what a user copies.

    python3 .ci/readme_command.py main    # "Run the main job" block
    python3 .ci/readme_command.py test    # "Run the tests" block
"""

import pathlib
import re
import sys

HEADINGS = {"main": "Run the main job", "test": "Run the tests"}


def command(which: str) -> str:
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index(HEADINGS[which])
    block = re.search(r"```bash\n(.*?)\n```", readme[start:], re.S)
    if block is None or "\n" in block[1].strip():
        sys.exit(f"README.md: no one-line bash block after {HEADINGS[which]!r}")
    return block[1].strip()


if __name__ == "__main__":
    print(command(sys.argv[1]))
