"""The models of one pool, their formats and pages as plain data, for a daemon restart, and
back into a fresh service's `Formats` (service_image.py keeps the rest: sessions, tenants).

What is kept: every model in registration order (name, number, geometry, runner target,
asleep), each format's pool (`core/pool_image.py`: tables, the prefix cache, held pages,
format 0's host tier index) and its records of whose its cached blocks and host copies are
(`PrivateBlocks`, `ModelCache`), and the page broker (which format holds each page, the moves
so far, the reserves still parked). Restored models are registered again in their order, so
each gets its number and format back; sessions name their model by name and number, and the
pools' holder groups by number, so a restore that numbers them otherwise is refused.

The [models.NAME] policies are the settings', not the snapshot's: a daemon whose policies
differ from the snapshot's refuses it (its parked reserves and page counts would disagree).

Refusals are InvalidArgument, nothing read further (the caller builds a fresh service).
"""

from typing import Any

from pagedkv.daemon.core import InvalidArgument
from pagedkv.daemon.core.pool_image import Image, pool_image, restore_image
from pagedkv.daemon.service.formats import Formats
from pagedkv.daemon.service.model_cache import ModelCache
from pagedkv.daemon.service.models import Format, KvShape, ModelRegistry
from pagedkv.daemon.service.private_blocks import PrivateBlocks


def models_image(formats: Formats) -> Image:
    """The models, formats and pages of `formats` (outside any transaction)."""
    registry = formats.models
    pools = []
    for fmt in registry.formats:
        pools.append({"pool": pool_image(fmt.pool),
                      "records": [record.image() for record in _records(fmt)]})
    return {"models": [[m.name, m.number, m.format.number, _shape_out(m.format.shape),
                        m.runner_target, m.asleep] for m in registry],
            "policies": _policies(registry), "formats": pools,
            "pages": formats.pages.image()}


def restore_models(formats: Formats, image: Image) -> None:
    """Put `image` into `formats`, fresh (the daemon's own model alone, no session).
    InvalidArgument: other policies, another own model, numbering or pool geometry."""
    registry = formats.models
    if image["policies"] != _policies(registry):
        raise InvalidArgument(f"model policies {image['policies']} in the snapshot, "
                              f"{_policies(registry)} now")
    for name, number, fmt_number, shape, runner_target, asleep in image["models"]:
        if number == 0 and name != registry.own.name:
            raise InvalidArgument(f"the snapshot's own model is {name!r}, this daemon's "
                                  f"{registry.own.name!r}")
        model = registry.own if number == 0 else registry.register(
            name, KvShape(*shape), runner_target, allow_new_format=True)
        if (model.number, model.format.number) != (number, fmt_number):
            raise InvalidArgument(f"model {name!r} restored as model {model.number} of format "
                                  f"{model.format.number}, kept as {number} of {fmt_number}")
        model.runner_target, model.asleep = runner_target, asleep
    for fmt, kept in zip(registry.formats, image["formats"], strict=True):
        restore_image(fmt.pool, kept["pool"])
        for record, kept_record in zip(_records(fmt), kept["records"], strict=True):
            record.restore(kept_record)
    formats.pages.restore(image["pages"])


def _records(fmt: Format) -> list[ModelCache | PrivateBlocks]:
    """A format's records of its cached blocks and host copies: whose they are."""
    hygiene = fmt.hygiene
    records: list[ModelCache | PrivateBlocks] = [hygiene.private, hygiene.cached]
    if hygiene.host is not None:
        records += [hygiene.host.private, hygiene.host.models]
    return records


def _shape_out(shape: KvShape) -> list[Any]:
    return [shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype]


def _policies(registry: ModelRegistry) -> list[list[Any]]:
    """The settings' policies as plain data, in name order."""
    return [[name, policy.min_memory, policy.max_memory]
            for name, policy in sorted(registry.policies.items())]
