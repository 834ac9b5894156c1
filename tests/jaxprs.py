"""Reading a traced program: every equation of a jaxpr and of the jaxprs inside it (loop bodies, branches, custom
rules, recomputed blocks)."""
import math


def equations(jaxpr, loops=()):
    """Each equation with the loop equations (scan, while) around it, outermost first."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn, loops
        inner = (*loops, eqn) if eqn.primitive.name in ("scan", "while") else loops
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else [p]:
                if hasattr(sub, "eqns"):
                    yield from equations(sub, inner)


def trips(loops) -> int:
    """How often an equation inside `loops` runs, counting scans' lengths (a while loop as once)."""
    return math.prod(loop.params["length"] for loop in loops if loop.primitive.name == "scan")
