"""The run side: a command confined behind its own managed proxy.

    options    what a run is asked (RunOptions) and what it returns (RunResult)
    facts      what the host supports, probed once and cached where no child can write
    own_state  egressbox's own state directory (probe cache, trusted policies, layers)
    assemble   the launch plan, assembled from options and facts before the fork
    spawn      fork the launcher, receive its listeners and what it applied
    zygote     the command line's launcher, forked before the plan exists
    supervise  serve the proxy until the command exits; why a failure happened
    api        run(), run_sync(), spawn_confined(), ConfinedProcess

Importing this package imports none of them: `egressbox run` forks before asyncio loads.
"""
