"""splitserve.plan, the P:D planner behind `splitserve plan`: how many prefill and decode workers
a trace needs under its SLOs, and what each choice costs per accepted response.

profile (the step-time and handoff model, fitted to the real engine and transport) -> simulator
(continuous batching, chunked prefill, the handoff and queueing, per replica) -> goodput (the A/B's
figures) -> search (colocated N against every xP:yD) -> cli (the table and the manifest).
"""
