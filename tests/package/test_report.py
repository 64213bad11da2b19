"""The one-file HTML report (figures/report.py): from Python, the app's Export tab and the command line; it
opens offline in Chromium with every chart drawn and nothing fetched, holds plotly.js once, and every text a
prompt or the model wrote is inert."""

from __future__ import annotations

from plotly.offline import get_plotlyjs

from gpt_shape_tracer.figures.report import report_html
from gpt_shape_tracer.tracer import TracedGeneration

PROMPTS = ["Tom had a big red kite.", "<script>alert(1)</script> said"]


def test_the_report_holds_plotly_once_the_views_and_inert_text(bundled, tmp_path):
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0)
    gen.run(3)
    page = report_html(gen.trace, heads=((0, 0), (1, 2)))
    assert page.count(get_plotlyjs()) == 1  # plotly.js written in once, not per figure
    assert page.count('class="plotly-graph-div"') == 7  # flow, two heads' stages, all heads, mask, cache, next token
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<code>blocks.3.attn.hook_pattern</code>" in page and "Step 2 of 3" in page
    assert len(page) < len(get_plotlyjs()) + 2 * 2**20  # the figures are pooled: bounded by the views
    opened_offline(page, tmp_path / "report.html", 7)


def opened_offline(page: str, path, figures: int) -> None:
    """Write ``page`` to ``path`` and open it in Chromium from the file: every one of ``figures`` charts draws,
    nothing is fetched, no script error, and no planted script ran."""
    from tests.app_in_browser import chromium

    path.write_text(page, encoding="utf-8")
    with chromium() as browser:
        view = browser.new_page()
        outside, errors = [], []
        view.on("request", lambda r: outside.append(r.url) if not r.url.startswith("file://") else None)
        view.on("pageerror", lambda e: errors.append(str(e)))
        view.goto(path.as_uri())
        view.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot').length === {figures}",
                               timeout=60_000)
        assert not outside and not errors and view.evaluate("() => window.__xss === undefined")


def test_the_command_line_writes_the_report(tmp_path, capsys):
    from gpt_shape_tracer.trace_command import main

    code = main(["--prompt", "Tom had a kite.", "--steps", "2", "--out", str(tmp_path / "t.zip"),
                 "--html", str(tmp_path / "r.html")])
    assert code == 0 and "a report of step 1" in capsys.readouterr().out
    assert (tmp_path / "r.html").read_text(encoding="utf-8").count('class="plotly-graph-div"') == 6


def test_the_report_of_a_whole_run_opens_offline_with_every_figure(bundled, tmp_path):
    from gpt_shape_tracer.figures.report import run_report_html

    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0)
    gen.run(20)
    page = run_report_html(gen.trace, heads=((0, 0), (1, 2)))
    figures = 1 + 2 + 1 + 20  # the cache over the steps, two heads over the steps, the prefill's flow, 20 next tokens
    assert page.count(get_plotlyjs()) == 1 and page.count('class="plotly-graph-div"') == figures
    assert len(page) < 8 * 2**20  # plotly.js (4.8 MB) once, the figures pooled
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "A run of 20 steps" in page
    for s in range(20):  # every step's row: its sizes and what each sequence chose, with p
        forward, chosen = gen.facts.step(s).forward, gen.facts.step(s).sampling
        assert f"<tr><td>{s}</td><td>{forward.n}</td><td>{forward.t}</td><td>{forward.cache_after}</td>" in page
        assert f"(p = {chosen.probs[1]:.3f})" in page
    opened_offline(page, tmp_path / "run.html", figures)


def test_the_command_line_writes_the_report_of_the_run(tmp_path, capsys):
    from gpt_shape_tracer.trace_command import main

    code = main(["--prompt", "Tom had a kite.", "--steps", "3", "--out", str(tmp_path / "t.zip"),
                 "--html-run", str(tmp_path / "run.html")])
    assert code == 0 and "a report of the 3 steps" in capsys.readouterr().out
    # the cache, one head over the steps, the flow, three next tokens
    assert (tmp_path / "run.html").read_text(encoding="utf-8").count('class="plotly-graph-div"') == 6


HOSTILE = "<img src=x onerror=window.__xss=1>"


def test_a_label_a_trace_file_carries_appears_only_escaped_in_both_reports(bundled):
    """Anyone can write a trace file: a chosen token's label (and a candidate's) is text from the file, and both
    reports write it escaped, never as markup."""
    import json

    from gpt_shape_tracer.figures.report import run_report_html
    from gpt_shape_tracer.tracer import load_trace
    from tests.tracer.test_tracer_io import archive_bytes, member, rewrite

    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPTS[0], temperature=0)
    gen.run(3)
    archive = archive_bytes(gen.trace)
    manifest = json.loads(member(archive, "manifest.json"))
    for step in manifest["generation"]["steps"]:
        step["sampling"]["labels"] = [HOSTILE]
        step["sampling"]["candidate_labels"][0][0] = HOSTILE
    crafted = load_trace(rewrite(archive, "manifest.json", json.dumps(manifest).encode()))
    assert crafted.generation.steps[1].sampling.labels == (HOSTILE,)

    for page in (report_html(crafted, 1), run_report_html(crafted)):
        assert HOSTILE not in page and "<img" not in page
        assert "&lt;img src=x onerror=window.__xss=1&gt;" in page  # shown, as text
