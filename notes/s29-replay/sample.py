import sys, pickle
sys.setrecursionlimit(10000)
T = 10**12
def fmt(e):
    if isinstance(e, tuple) and e:
        op = e[0]
        if op == 'g32':
            a = e[1]
            for name, base in (('post', 3*T), ('comb', 4*T), ('pre', 5*T)):
                if base <= a < base + T: return f'{name}@{(a-base)//4}'
        if op == 'g':
            return f'res@{(e[1]-2*T)//2}.w{e[2]}'
        if op == 'x': return f'x@{e[1]}.w{e[2]}'
        if op in ('lo','hi'):
            return f'{op}({fmt(e[1])})'
        if op == 'pack': return f'pack(...)'
        return f'{op}(' + ', '.join(fmt(x) for x in e[1:]) + ')'
    return repr(e)
o = pickle.load(open(sys.argv[1], 'rb'))
print(fmt(o['sample'][1]) if False else '')
