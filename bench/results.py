"""bench/RESULTS.md is shared: each benchmark owns the text between its <!-- NAME:begin --> and
<!-- NAME:end --> markers and replaces only that, atomically."""
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def write_section(name: str, body: str, path: str = RESULTS) -> None:
    """Replace what is between <!-- name:begin --> and <!-- name:end --> (append the section if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = open(path).read() if os.path.exists(path) else "# ccld benchmark results\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text and text.index(begin) < text.index(end):
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = f"{path}.{name}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
