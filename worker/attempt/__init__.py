"""How one attempt starts, stage by stage, as worker/supervisor.py runs them top to bottom:

place (place.py: its devices, cores and memory share) → prepare (prepare.py: its code, folders, torchrun's
command line and environment) → sandbox (start.enclose: bwrap around it, its cgroup) → launch
(start.launch_attempt: torchrun in a session of its own, pinned to its cores) → watch and ship (the supervisor's
loop; ship.py: output, metrics and what the watch found, to the database) → outcome.py (what its end means).
"""
