"""The member engine: one peer's round, whoever's clock it runs on.

``engine`` owns the round (block turns, the apply delay, the block after adopting a state,
replay, re-sync); ``outer`` the outer state and its step; ``methods`` the outer methods as
functions of a round's deliveries; ``sender`` the codec choice and error feedback of what goes
out; ``pacing`` when a published fragment's step is taken. The daemon drives it with the wall
clock and the network; the simulator with a virtual clock and the in-memory network.
"""
