"""Front ends in processes of their own: workers that hold the clients' connections and relay to the owning process.

relay.py is the channel between them, pool.py the owning process's side
(the workers' supervisor and the relayed calls' dispatcher), worker.py the
worker process. docs/architecture.md, "Front-end workers", shows the
process layout.
"""
