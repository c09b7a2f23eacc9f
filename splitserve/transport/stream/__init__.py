"""The stream backends: one payload mover (mover.py, `StreamMover`) over each backend's wire: tcp.py
(the blocks as bytes on the control connection) and shm.py (POSIX shared memory on one host)."""
