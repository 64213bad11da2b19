"""Repository hygiene that CI depends on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip() and not
                line.strip().startswith("#")]
    assert ci in commands, "the README's test command and .ci/run must be the same line"
    assert any(c.endswith("streamlit run app.py") for c in commands)


def test_packages_keep_their_dependency_direction():
    """model ← tracer ← app: model imports neither; tracer never imports streamlit."""
    for path in (ROOT / "model").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import) (tracer|figures|streamlit|session)\b", text, re.M), path
    for path in [*(ROOT / "tracer").glob("*.py"), *(ROOT / "figures").glob("*.py"), ROOT / "session.py"]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import) streamlit\b", text, re.M), path


def test_the_bundled_model_is_small_enough_to_ship():
    files = list((ROOT / "assets" / "story-gpt").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) < 20 * 2**20
