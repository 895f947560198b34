"""docs/configs.md lists exactly the fields the config classes have (generated reference)."""

from pathlib import Path

from meshrl.runtime.config_docs import MARKER, page_with_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configs.md"


def test_configs_page_matches_the_code():
    page = PAGE.read_text()
    assert MARKER in page
    assert page == page_with_reference(page), "run `python -m meshrl.runtime.config_docs --write`"


def test_reference_covers_nested_sections():
    page = PAGE.read_text()
    for field in ("`trainer.parallel.ep`", "`inference.sampling.temperature`", "`checkpoint.every`",
                  "`model.impl`", "`resume`"):
        assert field in page, field
