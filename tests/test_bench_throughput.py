"""bench/published_throughput.py's diagnostic: the two factors it reports are the ones that turn the
model's parts into the published steps."""

from bench.published_throughput import _split_fit


def test_split_fit_recovers_the_factors_of_exact_samples():
    parts = [(1.0, 0.1), (0.8, 0.4), (0.5, 1.5), (0.3, 2.0)]
    samples = [(n, a, 1.2 * n + 0.8 * a) for n, a in parts]
    rest, attention, residual = _split_fit(samples)
    assert abs(rest - 1.2) < 1e-9 and abs(attention - 0.8) < 1e-9 and residual < 1e-9


def test_split_fit_reports_what_two_factors_cannot_explain():
    samples = [(1.0, 0.1, 1.0), (1.0, 0.1, 1.3), (0.5, 1.5, 2.0), (0.3, 2.0, 2.3)]
    assert _split_fit(samples)[2] > 0.01


def test_share_bins_cover_every_share_once():
    from bench.published_throughput import COMMUNICATION_BINS, _share_bin

    assert [_share_bin(x) for x in (0.0, 0.049, 0.05, 0.099, 0.1, 0.199, 0.2, 0.9)] == [
        "<5%", "<5%", "5-10%", "5-10%", "10-20%", "10-20%", ">=20%", ">=20%"]
    assert len({_share_bin(x / 100) for x in range(100)}) == len(COMMUNICATION_BINS) + 1
