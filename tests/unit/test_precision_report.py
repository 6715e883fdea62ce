"""`flashmoe precision-report`: its JSON and table on tiny shapes (--quick), and the
real-shape rows' errors in the band the format gives."""

import json

import pytest

from flashmoe.bench import precision_report
from flashmoe.cli.main import main

KEYS = {"family", "precision", "mean_rel_error", "kl", "top1_agreement", "ties"}


def test_report_through_the_command(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["precision-report", "--quick", "--shape", "gpt-oss-tiny", "--budget", "0.5",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["budget_fraction"] == 0.5 and doc["group_size"] == 32
    rows = {(r["family"], r["precision"]): r for r in doc["results"]}
    families = (*precision_report.TINY_FAMILIES, "gpt-oss-tiny")
    assert set(rows) == {(f, p) for f in families for p in precision_report.PRECISIONS}
    for family in families:
        assert all(KEYS <= set(rows[family, p]) for p in precision_report.PRECISIONS)
        native, int8, int4 = (rows[family, p] for p in precision_report.PRECISIONS)
        assert native["mean_rel_error"] == 0.0
        assert 0 < int8["mean_rel_error"] < int4["mean_rel_error"]
        if family == "gpt-oss-tiny":  # no logits
            assert all(r["kl"] is None and r["top1_agreement"] is None and r["ties"] is None
                       for r in (native, int8, int4))
        else:  # a rerun of the native model is the native model, bit for bit
            assert native["kl"] == 0.0 and native["top1_agreement"] == 1.0
            assert native["carried_rel_error"] == 0.0
            assert int8["kl"] >= 0 and int4["kl"] >= 0 and native["ties"] >= 0
    table = capsys.readouterr().out
    assert "gpt-oss-tiny" in table and "int4" in table and f"wrote {out}" in table


def test_real_shape_rows():
    """gpt-oss-20b's projections at the e2e benchmark's scale (a few tokens of one layer):
    synth-store's intermediate, and errors in the band of per-channel INT8 (~1-1.5%) and
    group-32 INT4 (~15-18%)."""
    rows = {r["precision"]: r for r in precision_report.shape_rows(
        "gpt-oss-20b", 0.21, layers=1, experts=4, tokens=2)}
    assert rows["native"]["intermediate"] == 608 and rows["native"]["mean_rel_error"] == 0
    assert 0.005 < rows["int8"]["mean_rel_error"] < 0.03
    assert 0.08 < rows["int4"]["mean_rel_error"] < 0.3


def test_budget_is_a_fraction(capsys):
    with pytest.raises(SystemExit):
        main(["precision-report", "--budget", "0"])
    assert "fraction" in capsys.readouterr().err
