"""Samples of a Prometheus text exposition (a /metrics body), read with prometheus_client's own
parser, so a test names a series and the labels it cares about, not the line's exact text."""

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> list[Sample]:
    """Every sample of `text`."""
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of the first sample named `name` whose labels include `labels`."""
    for sample in samples(text):
        if sample.name == name and labels.items() <= sample.labels.items():
            return sample.value
    raise AssertionError(f"no sample {name} with labels {labels} in:\n{text}")
