"""KFP component: the recovery benchmark's comparison (a thin wrapper over compare.py)."""

# No `from __future__ import annotations` here: KFP reads the real annotation objects.

from kfp import dsl

from resilient_training.launch import images


@dsl.component(base_image=images.COMPONENTS_IMAGE, install_kfp_package=False)
def compare_strategies(
    run_dirs: list[str],
    comparison: dsl.Output[dsl.HTML],
    table: dsl.Output[dsl.Markdown],
    rows: dsl.Output[dsl.Artifact],
) -> str:
    """Line the strategies up: goodput, recovery time by layer, rollback, checkpoint stall.

    Args:
        run_dirs: One run directory per strategy (the output of each ``run_strategy``).
        comparison: Output HTML: the table and goodput/recovery charts, self-contained.
        table: Output Markdown: the comparison table.
        rows: Output JSON artifact: the numbers of every row.

    Returns:
        The comparison as a plain-text table.

    """
    import json

    from resilient_training.bench.compare import compare, markdown_table, render_html, text_table

    found = compare(run_dirs)
    with open(comparison.path, "w", encoding="utf-8") as handle:
        handle.write(render_html(found))
    with open(table.path, "w", encoding="utf-8") as handle:
        handle.write("# Recovery benchmark\n\n" + markdown_table(found) + "\n")
    with open(rows.path, "w", encoding="utf-8") as handle:
        json.dump(found, handle, indent=1, allow_nan=True)
    text = text_table(found)
    print(text)
    return text
