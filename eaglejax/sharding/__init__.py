"""Running eaglejax over a device mesh: tensor parallelism (`tp`) and data parallelism
(`dp`), on one host or many (`jax.distributed`).

`make_mesh` builds the mesh; `rules` maps the logical axis names that parameters, caches
and activations carry onto its axes; `placement` puts weights straight into their
shardings; `distributed` starts and coordinates several processes.
"""

from eaglejax.sharding.mesh import make_mesh
from eaglejax.sharding.rules import RULES, constrain, logical_spec

__all__ = ["RULES", "constrain", "logical_spec", "make_mesh"]
