"""The README's two commands are what CI and a newcomer run: .ci/run must run the test command verbatim."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The one-line commands of the README's bash blocks under "Two commands for a fresh machine"."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands for a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    main_job, tests = readme_commands()
    assert "toy/main_job.sh" in main_job and "pytest tests" in tests
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci  # verbatim: CI resolves the same versions a newcomer gets
    assert "python3 -m venv" in ci and ci.index("python3 -m venv") < ci.index(tests)
