"""mla_tune.views.plot and `mla-tune report --plot`: the PNG opens and shows what its titles say."""

import json

import pytest
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.views.plot import plot_report, report_figure
from mla_tune.store.selection import TrialFilter
from mla_tune.views.report import build_report
from mla_tune.store.results import ResultsStore
from results_fixture import build_fixture_db

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture()
def fx(tmp_path):
    return build_fixture_db(tmp_path / "results.db")


def _titles(fig):
    return [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]


def test_small_multiples_show_tuned_vs_default_and_roofline(fx):
    import matplotlib.pyplot as plt

    from mla_tune.views.plot import bucket_points

    with ResultsStore(fx.path) as s:
        rep = build_report(s, TrialFilter(device="NVIDIA H200"))
    fig = report_figure(rep)
    try:
        titles = _titles(fig)
        assert "tuned vs default speed-up and % of roofline per bucket" in titles[0]
        gain = [a for a in fig.axes if "tuned vs untuned default" in a.get_title()]
        roof = [a for a in fig.axes if "% of roofline (copy 4000 GB/s" in a.get_title()]
        assert len(gain) == len(roof) == len(rep.devices[0].choice.models)
        assert all("NVIDIA H200" in a.get_title() and "page 64" in a.get_title() for a in gain)
        # one line per batch size; its points are default / served time per bucket
        dev = rep.devices[0]
        m = dev.choice.models[0]
        ax = gain[0]
        series = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 1 and ln.get_linestyle() == "-"]
        want = {}
        for b in m.buckets:
            fi = b.families["flashinfer"]
            want.setdefault(b.batch_size, []).append((b.context_len, fi.default_time_us / fi.time_us))
        got = sorted(sorted(zip(ln.get_xdata(), ln.get_ydata())) for ln in series)
        assert got == sorted(sorted(v) for v in want.values() if len(v) > 1)
        # the fixture's fa3 beats the default (auto) in every bucket: every point above 1
        assert all(p.speedup > 1.0 and p.family == "flashinfer" for p in bucket_points(dev, m))
        assert all(0 < p.pct_roofline <= 100 for p in bucket_points(dev, m))
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "batch 1" in legend and "served: FlashInfer" in legend
        assert len(legend) < 15          # a legend of batch sizes and families, not of candidates
    finally:
        plt.close(fig)


def test_png_opens(fx, tmp_path):
    import matplotlib.image as mpimg

    with ResultsStore(fx.path) as s:
        path = plot_report(build_report(s), tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 1000 and img.shape[1] > 1200      # three devices, stacked
    assert img[..., :3].std() > 0.05                          # not a blank canvas


def test_reference_only_says_no_roofline(fx):
    import matplotlib.pyplot as plt

    with ResultsStore(fx.path) as s:
        fig = report_figure(build_report(s, TrialFilter(device="cpu")))
    try:
        titles = _titles(fig)
        assert any("CPU torch reference, no verdict" in t for t in titles)
        assert not any("speed-up" in a.get_ylabel() for a in fig.axes if a.axison)
    finally:
        plt.close(fig)


def test_cli_plot_keeps_json_on_stdout(fx, tmp_path):
    png = tmp_path / "r.png"
    res = runner.invoke(app, ["report", "--db", str(fx.path), "--plot", str(png), "--format", "json",
                              "--device", "MetaX C500"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["devices"][0]["device_name"] == "MetaX C500"
    assert f"wrote {png}" in res.stderr and png.stat().st_size > 10_000
