"""Reports from mha_bench results: tables, plots, Markdown and a self-contained HTML page."""
