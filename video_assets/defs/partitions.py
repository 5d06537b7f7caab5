from dagster import DynamicPartitionsDefinition

# One partition per upload batch; keys are added by the upload sensor or `video-assets register`.
video_batches = DynamicPartitionsDefinition(name="video_batches")


def consecutive_ranges(order: list[str], keys: list[str]) -> list[tuple[str, str]]:
    """``keys`` as (first, last) ranges of consecutive partitions in ``order`` (the partitions' order)."""
    wanted, ranges, previous = set(keys), [], None
    for i, key in enumerate(order):
        if key in wanted:
            if ranges and previous == i - 1:
                ranges[-1] = (ranges[-1][0], key)
            else:
                ranges.append((key, key))
            previous = i
    return ranges
