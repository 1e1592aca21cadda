from .vsa import vsa_reference, vsa_reference_scores  # noqa: F401  (dense VSA oracle, spec vsa.md §8)
from .sla import sla_reference, sla_reference_scores  # noqa: F401  (dense SLA oracle, spec sla.md §9)
