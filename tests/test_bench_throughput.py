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
