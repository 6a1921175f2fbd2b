"""Every test that starts the CLI, a process, a sweep or a fit carries the ``e2e`` marker (tests/tiers.py reads which)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.helpers import ROOT
from tests.tiers import e2e_candidates


def test_every_test_that_starts_a_run_carries_the_e2e_marker():
    missing = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        infos, file_marked = e2e_candidates(path)
        missing += [f"{path.relative_to(ROOT)}:{i.line} {i.name}" for i in infos if not (i.marked or file_marked)]
    assert not missing, "mark these @pytest.mark.e2e (they start the CLI, a process, a sweep or a fit):\n" + "\n".join(missing)


def test_the_reader_finds_each_way_of_starting_a_run(tmp_path: Path):
    source = textwrap.dedent('''
        import subprocess
        import pytest
        from lowrank_lit.cli import main
        from tests.helpers import run_cli, quiet_trainer

        @pytest.fixture
        def fitted(tmp_path):
            return run_cli("fit", run_root=tmp_path)

        def _helper(m):
            quiet_trainer().fit(m)

        def test_cli(): main(["list"])
        def test_subprocess(): subprocess.run(["true"])
        def test_fixture(fitted): pass
        def test_helper(): _helper(None)
        @pytest.mark.e2e
        def test_marked(): run_cli("fit", run_root=None)
        @pytest.mark.slow
        def test_slow(): run_cli("fit", run_root=None)
        def test_pure(): assert 1 + 1 == 2
        def test_a_method_called_run(): object().run()
    ''')
    path = tmp_path / "test_x.py"
    path.write_text(source)
    infos, file_marked = e2e_candidates(path)
    assert {i.name: i.marked for i in infos} == {"test_cli": False, "test_subprocess": False, "test_fixture": False,
                                                 "test_helper": False, "test_marked": True}
    assert not file_marked
    path.write_text("import pytest\npytestmark = pytest.mark.e2e\n" + source)
    assert e2e_candidates(path)[1]
