"""The markdown table the benchmark scripts print (docs/ pages quote them)."""


def markdown_table(rows: list[dict]) -> str:
    """Rows as a markdown table, every key of any row a column (in order of appearance; blank where a row lacks it)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
