"""Positional encodings of the decoder: one module per family behind one small interface
(``PositionalEncoding``, see ``base``), found by name in ``REGISTRY``.

To add an encoding: write ``jaxpe/model/encodings/<name>.py`` with a ``@register("<name>")``
subclass of ``PositionalEncoding`` overriding the hooks it needs, add its import line below and its
name to ``jaxpe.model.config.POS_ENCODINGS`` (the built-in names). ``ModelConfig(pos_encoding="<name>")`` then builds a decoder with it (the config accepts every
registered name; an encoding registered from outside the package, after ``import jaxpe.model``,
is accepted as well).
"""

from jaxpe.model.encodings.base import REGISTRY, PositionalEncoding, emulation_theta, for_config, register

# The registration: importing a module registers its encoding (into jaxpe.model.config.ENCODINGS,
# the table the config reads). The order of these lines is the order of config.POS_ENCODINGS.
# isort: off
from jaxpe.model.encodings import none  # noqa: F401
from jaxpe.model.encodings import learned  # noqa: F401
from jaxpe.model.encodings import sinusoidal  # noqa: F401
from jaxpe.model.encodings import rope  # noqa: F401
from jaxpe.model.encodings import xpos  # noqa: F401
from jaxpe.model.encodings import alibi  # noqa: F401
from jaxpe.model.encodings import rope_alibi  # noqa: F401
from jaxpe.model.encodings import cope  # noqa: F401
from jaxpe.model.encodings import t5  # noqa: F401
from jaxpe.model.encodings import kerple  # noqa: F401
from jaxpe.model.encodings import fire  # noqa: F401
# isort: on

__all__ = ["REGISTRY", "PositionalEncoding", "emulation_theta", "for_config", "register"]
