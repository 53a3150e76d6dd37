"""bench/summary.py: the within-15% count, the median |error| and the median signed error every
published-throughput bench prints, with its two variants."""

from bench.summary import WITHIN, error_summary


def test_summary_arithmetic():
    assert WITHIN == 0.15
    assert error_summary([0.1, -0.2, 0.05], span=True) == ("2/3 within 15%, median |error| 10.0%, median signed "
                                                          "+5.0%, range -20.0% to +10.0%")
    assert error_summary([-0.15, 0.16], span=True).startswith("1/2 within 15%, median |error| 15.5%, median signed "
                                                             "+0.5%")


def test_the_share_variant_and_an_empty_list():
    assert error_summary([0.1, -0.2, 0.05], share=True) == ("2/3 (67%) within 15%, median |error| 10.0%, median "
                                                           "signed +5.0%")
    assert error_summary([0.1, -0.2, 0.05]) == "2/3 within 15%, median |error| 10.0%, median signed +5.0%"
    assert error_summary([]) == "-"
