import simstate
def jit(f): return f
def kernel(f): return f
def make_layout(shape): return shape
class Tensor: pass
class _Arch:
    @staticmethod
    def thread_idx(): return (simstate.tls.tid, 0, 0)
    @staticmethod
    def block_idx(): return (simstate.tls.bid, 0, 0)
    @staticmethod
    def sync_threads():
        simstate.ev('bar', None)
        simstate.barrier.wait()
    @staticmethod
    def griddepcontrol_wait(): pass
    @staticmethod
    def griddepcontrol_launch_dependents(): pass
    @staticmethod
    def cluster_arrive_relaxed(): pass
arch = _Arch()
