"""ft bench's generation rate: tokens after every request's first, as llama-batched-bench's S_TG."""

from ft.bench import decode_rate


def test_the_decode_rate_counts_from_the_last_first_token() -> None:
    # A's first chunk (2 tokens) at 0.1 s, B's at 0.3 s (A had 4 tokens by then); both end at 0.5 s
    progress = [[(0.1, 2), (0.2, 3), (0.3, 4), (0.5, 6)], [(0.3, 1), (0.5, 3)]]
    assert decode_rate(progress, 0.5) == 20.0  # (6 - 4) + (3 - 1) tokens in 0.2 s


def test_the_decode_rate_of_nothing_is_zero() -> None:
    assert decode_rate([], 1.0) == 0.0
    assert decode_rate([[], [(1.0, 1)]], 1.0) == 0.0  # the last first token ends the level
