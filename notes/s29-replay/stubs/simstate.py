import threading
tls = threading.local()
shared = {}           # byte address -> symbolic word
coef_region = None    # (start byte, size bytes)
barrier = None
log = {}              # tid -> list of store records
events = {}           # tid -> list of (kind, info)
def ev(kind, info):
    events.setdefault(tls.tid, []).append((kind, info))
