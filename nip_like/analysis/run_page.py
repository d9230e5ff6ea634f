"""A run's page: one HTML file with its curves, final metrics, config and latest transcripts.

The page is self-contained (the figure is embedded), so it can be copied or
mailed on its own. For each run it shows whether it finished, the facts of
``summary.json`` (frames, iterations, train seconds, run id), the final
``test/...`` metrics, the resolved ``config.yaml`` and the first records of
its latest transcripts (``transcripts/test.jsonl``, else the last
evaluation's ``transcripts/eval_<iteration>.jsonl``), for the scenarios
whose agents talk.
"""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path
from typing import Any, Sequence

from nip_like.analysis.runs import Run
from nip_like.experiment import CONFIG_FILE

#: Transcript records shown per run.
TRANSCRIPT_RECORDS = 5

#: Facts of summary.json shown above the metrics, in this order.
SUMMARY_FACTS = ("run_id", "trainer_type", "seed", "iterations", "frames", "gradient_steps", "train_seconds", "stopped_early")

STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 80em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; }
img { max-width: 100%; }
"""


def latest_transcripts(run: Run) -> tuple[Path | None, list[dict[str, Any]]]:
    """The run's latest transcripts file and its first :data:`TRANSCRIPT_RECORDS` records (``(None, [])`` if none)."""
    folder = run.folder / "transcripts"
    test = folder / "test.jsonl"
    path = test if test.is_file() else max(folder.glob("eval_*.jsonl"), default=None)
    if path is None:
        return None, []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                records.append({"unreadable line": line})
        if len(records) == TRANSCRIPT_RECORDS:
            break
    return path, records


def _table(rows: Sequence[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{escape(str(key))}</th><td>{escape(_shown(value))}</td></tr>" for key, value in rows)
    return f"<table>{cells}</table>"


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run_section(run: Run, label: str) -> str:
    """The HTML of one run: status, summary facts, final metrics, latest transcripts and config."""
    parts = [f"<h2>{escape(label)}</h2>", f"<p>Folder: <code>{escape(str(run.folder.resolve()))}</code></p>"]
    summary = run.summary
    if summary:
        parts.append("<p>Finished.</p>")
        parts.append(_table([(key, summary[key]) for key in SUMMARY_FACTS if key in summary]))
        metrics = summary.get("test_metrics") or {}
        parts.append("<h3>Final test metrics</h3>")
        parts.append(_table(sorted(metrics.items())) if metrics else "<p>None recorded.</p>")
    else:
        parts.append("<p>Not finished: no summary.json yet (no final metrics).</p>")
    path, records = latest_transcripts(run)
    if records:
        parts.append(f"<h3>Latest transcripts: {escape(path.name)} (first {len(records)})</h3>")
        parts += [f"<pre>{escape(json.dumps(record, indent=1))}</pre>" for record in records]
    else:
        parts.append("<h3>Transcripts</h3><p>None: this run's scenario writes none, or no evaluation ran yet.</p>")
    parts.append("<h3>Config</h3>")
    parts.append(f"<pre>{escape((run.folder / CONFIG_FILE).read_text())}</pre>")
    return "\n".join(parts)


def write_run_page(runs: Sequence[Run], labels: Sequence[str], metrics: Sequence[str], png: Path, path: Path) -> Path:
    """Write the HTML page of ``runs`` to ``path``, with the figure ``png`` embedded; return ``path``.

    Parameters
    ----------
    runs : sequence of Run
        The runs, in the figure's order.
    labels : sequence of str
        Their names on the page.
    metrics : sequence of str
        The metrics the figure draws.
    png : Path
        The figure.
    path : Path
        The HTML file to write.
    """
    image = base64.b64encode(Path(png).read_bytes()).decode()
    title = labels[0] if len(runs) == 1 else f"{len(runs)} runs: {', '.join(labels)}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f"<p>Curves: {escape(', '.join(metrics))}.</p>",
        f'<img alt="learning curves" src="data:image/png;base64,{image}">',
        *(run_section(run, label) for run, label in zip(runs, labels)),
    ]
    html = (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path
