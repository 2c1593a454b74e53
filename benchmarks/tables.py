"""The markdown table the benchmark scripts print (docs/ pages quote them)."""


def markdown_table(rows: list[dict]) -> str:
    """Rows of equal keys as a markdown table, the keys as its header."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
