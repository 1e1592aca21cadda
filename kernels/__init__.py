from .vsa import vsa_attention, vsa_select  # noqa: F401  (VSA: coarse + top-K block-sparse fine attention)
from .sla import sla_attention, sla_select  # noqa: F401  (SLA: top-K sparse + linear attention)
