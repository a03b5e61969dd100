"""The worker side of parameter-server training: what a chief or worker task runs.

`optimizer.py` (`PSOptimizer`, what `strategy.setup` returns) drives each step through
`client.py` (`PSClient`: the calls to every ps task, one `channel.py` per task, over remote calls or a
same-host link, `linked.py`), `recovery.py` goes on after a lost ps (restoring a checkpoint,
`reshard.py` when the ps count changed), `local_steps.py` runs local-steps (geo) rounds, and
`lookups.py` runs a model's embedding tables through the ps. This side talks to the ps only
through `ps/messages.py`; it imports nothing of `ps/server/`.
"""
