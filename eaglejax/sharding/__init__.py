"""Running eaglejax over a device mesh: tensor parallelism (`tp`) and data parallelism
(`dp`), on one host or many (`jax.distributed`).

`make_mesh` builds the mesh; `rules` maps the logical axis names that parameters, caches
and activations carry onto its axes; `distributed` starts and coordinates several
processes. Putting a model's weights into their shardings is `eaglejax.models.placement`;
the compiled loops lowered for meshes of devices this host lacks are `eaglejax.programs`.
"""

from eaglejax.sharding.mesh import make_mesh
from eaglejax.sharding.rules import RULES, constrain, logical_spec

__all__ = ["RULES", "constrain", "logical_spec", "make_mesh"]
