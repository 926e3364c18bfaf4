"""The sample-side harness of the verdict (issues 22, 28 and 51).

:data:`DRIVER` runs as ``python -I -S -B -c DRIVER`` inside the sandbox. It reads ``main.py`` and the calls from an
inherited file, runs the program as module ``__main__``, then for each assert's sent call evaluates it in Python's
order: the root looked up in the program's globals only (a missing name is a NameError: a builtin
never answers for the candidate), the attributes, then each argument left to right (a call of the candidate's
among them evaluated there, its object passed on as Python would), then the call. It writes ``[index, "ok",
value(, state)]`` / ``[index, "err", "Type: message"]`` lines; then ``os._exit(0)``. Its serialiser sends the
builtin types by exact type (numbers, str, bytes, bool, None, list/tuple/dict/set/frozenset). Dict views (an
``OrderedDict``'s too), ``range``, ``bytearray``, ``Fraction``, ``Decimal``, ``deque``, ``Counter``, ``OrderedDict``
(its own order), ``defaultdict`` (of a builtin type), namedtuples, ``date`` / ``time`` / ``datetime`` (a fixed-offset
``timezone``) / ``timedelta``, ``Enum`` members and dataclass instances (without methods of their own) go tagged and
come back as the same type (issue 51: an ``OrderedDict`` sent as a dict compared without its order). Any other
subclass of a builtin fails with one line: its own equality and methods cannot travel. The nan objects of one value
are numbered, so identity survives (``[x] == [x]`` is True for one nan object), and ``math.nan`` / ``cmath.nan``
are named. ``state`` (only when not the default): the candidate's decimal context and int-digit limit after the
call, which Python's check would run under. A lazy iterator (a generator, ``map``, ``filter``, any iterator) that
is the whole value is drained right after its call - the last thing its assert runs in the sample, so nothing of
the candidate's runs between - within a list's budgets (:data:`.trusted.BUDGETS` ``elements`` per value, its own
node counting one, and ``value_bytes``, the values file's cap), and is replayed on the trusted side as an iterator
of the same kind ending the same way (exhausted, the exception it raised, or cut at the budget); an iterator inside
a container fails. Each item is encoded when it is yielded and, unless it is immutable (numbers, str, bytes, None,
tuples / frozensets of those), again after the drain: ``list(v)`` would hold it in its final state, a comprehension
reads it as it comes, so an item that changed in between (one buffer yielded again and again) ends the value there
("changed"), and a check that consumes it fails with one line. Anything else fails. The decoder trusts nothing
the encoder claims.
"""

from __future__ import annotations

from .trusted import BUDGETS
from .verify import SOURCE as VERIFY_SOURCE

# The sample-side harness (runs in the sandbox as `python -I -S -B -c DRIVER <json>`, stdlib only). Its values are
# only trusted as *values*: whatever it does to itself, it can only report plain data back.
DRIVER = VERIFY_SOURCE + r"""

def _tdlm_driver():
    import _collections_abc, marshal, os, sys, types
    payload_fd, out, *verify_fd = (int(x) for x in sys.argv[1].split(","))
    chunks = []
    while True:
        c = os.read(payload_fd, 1 << 20)
        if not c:
            break
        chunks.append(c)
    os.close(payload_fd)
    program, calls, *expect = marshal.loads(b"".join(chunks))  # written by the trusted side
    del chunks
    # What holds, seen from here - after the namespaces, root, rlimits, uid drop and seccomp, before the candidate's
    # code (tdlm/evaluation/sandbox/verify.py). The line is written and its pipe closed first: the candidate can
    # neither write nor rewrite it. A required guarantee not held, or a report that cannot be sent: never run it.
    # (The evaluator always sends both; the driver alone, as the wire tests run it, reports nothing - and a run
    # that reports nothing is never scored.)
    if expect:
        expect = expect[0]
        facts = sandbox_facts(expect)
        try:
            os.write(verify_fd[0], (repr(facts) + "\n").encode())
            os.close(verify_fd[0])
        except (OSError, IndexError):
            os._exit(125)
        held = guarantees_held(facts, expect)
        missing = [k for k in expect["require"] if not held.get(k)]
        if missing:
            os.write(2, ("sandbox: not held inside the sample's process: " + ", ".join(missing) + "\n").encode())
            os._exit(125)
        del facts, held
    del expect, verify_fd
    path = os.path.abspath("main.py")  # cwd: /tmp of the new root (weak mode: an empty host directory)
    try:
        with open(path, "w", encoding="utf-8") as f:  # for tracebacks / inspect; the run does not read it back
            f.write(program)
    except OSError:
        pass
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv[:] = ["main.py"]
    code = compile(program, path, "exec", dont_inherit=True)
    if calls is None:
        del program
        exec(code, main.__dict__)
        return
    del program
    try:  # the C string escaper of the json package, without importing json (its import costs ~30 ms)
        from _json import encode_basestring_ascii as quote
    except ImportError:
        def quote(s):
            out = []
            for ch in s:
                n = ord(ch)
                if 0x20 <= n < 0x7F and ch not in '"\\':
                    out.append(ch)
                elif n < 0x10000:
                    out.append("\\u%04x" % n)
                else:
                    out.append("\\u%04x\\u%04x" % (0xD7C0 + (n >> 10), 0xDC00 + (n & 0x3FF)))
            return '"' + "".join(out) + '"'
    write, _hex, _isinstance, _type, _next, _iter = os.write, float.hex, isinstance, type, next, iter
    mods = sys.modules
    # Exact builtins by exact type; an instance of a subclass goes as itself where the trusted side rebuilds that
    # type (Counter, OrderedDict, defaultdict, namedtuple, deque ...) and fails otherwise: a subclass's own
    # equality and methods do not travel, and the base type's value would be judged with the base type's (an
    # OrderedDict compared as a dict ignores order).
    SEQ = {list: "l", tuple: "t", set: "s", frozenset: "z"}
    VIEWS = ((type({}.keys()), "vk"), (type({}.values()), "vv"))
    ITEMS = type({}.items())
    ITER = _collections_abc.Iterator
    # a drained value's budgets are a list's: the decoder's elements per value (its own node counts one) and the
    # values file's cap (past it the whole file fails, as it does for a list that long)
    LAZY_ITEMS, LAZY_BYTES = @ELEMENTS@ - 1, @VALUE_BYTES@
    SCALARS = frozenset((int, float, complex, str, bytes, bool, _type(None)))
    FACTORIES = {None: "null", int: '"int"', float: '"float"', str: '"str"', bytes: '"bytes"', bool: '"bool"',
                 complex: '"complex"', list: '"list"', tuple: '"tuple"', dict: '"dict"', set: '"set"',
                 frozenset: '"frozenset"'}
    NT_KEYS = frozenset(("__doc__", "__getnewargs__", "__match_args__", "__module__", "__new__", "__repr__",
                         "__slots__", "_asdict", "_field_defaults", "_fields", "_make", "_replace", "__replace__",
                         "__annotations__", "__orig_bases__", "__firstlineno__", "__static_attributes__"))
    INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    ENUM_EXTRA = frozenset(("_ignore_", "__firstlineno__", "__static_attributes__", "__qualname__", "__annotations__"))
    DC_KEYS = frozenset(("__annotations__", "__dataclass_fields__", "__dataclass_params__", "__dict__", "__doc__",
                         "__eq__", "__hash__", "__init__", "__match_args__", "__module__", "__repr__", "__weakref__",
                         "__lt__", "__le__", "__gt__", "__ge__", "__setattr__", "__delattr__", "__getstate__",
                         "__setstate__", "__slots__", "__firstlineno__", "__static_attributes__", "__qualname__",
                         "__replace__"))  # fmt: skip
    STDLIB = getattr(sys, "stdlib_module_names", ())
    enums = {}  # Enum class -> its encoding (one functional rebuild per class and run)
    nans = {}  # id -> (number, object): one value's nan objects, so identity survives (`[x] == [x]` is True)

    def hexint(n):
        return '"%s"' % int.__format__(int(n), "x")

    def nan(v, text):
        # nan != nan, but containers compare by identity first: which nan objects are one object matters
        for name in ("math", "cmath"):
            m = mods.get(name)
            if m is not None and v is m.nan:
                return '["n",%s]' % quote(name)
        k = nans.setdefault(id(v), (len(nans), v))[0]
        return '["n",%d,%s]' % (k, text)

    def enc(v, depth):
        if v is None:
            return "null"
        if v is True or v is False:
            return "true" if v else "false"
        if depth > 64:
            raise ValueError("nested deeper than 64")
        t = _type(v)
        if t is int:
            return '["i","%s"]' % int.__format__(v, "x")
        if t is float:
            return '["f","%s"]' % _hex(v) if v == v else nan(v, '["f","%s"]' % _hex(v))
        if t is complex:
            text = '["c","%s","%s"]' % (_hex(v.real), _hex(v.imag))
            return text if v == v else nan(v, text)
        if t is str:
            return quote(v)
        if t is bytes:
            return '["b","%s"]' % v.hex()
        if t is dict:
            return '["d",%s]' % pairs(dict.items(v), depth)
        tag = SEQ.get(t)
        if tag is not None:
            return '["%s",[%s]]' % (tag, ",".join(enc(x, depth + 1) for x in v))
        return other(v, t, depth)

    def pairs(items, depth):
        return "[%s]" % ",".join('["t",[%s,%s]]' % (enc(k, depth + 2), enc(x, depth + 2)) for k, x in items)

    def other(v, t, depth):
        # values a builtin above cannot hold, rebuilt as the same type by the trusted side
        for vt, tag in VIEWS:
            if t is vt:
                return '["%s",[%s]]' % (tag, ",".join(enc(x, depth + 1) for x in v))
        if t is ITEMS:
            return '["vi",%s]' % pairs(v, depth)
        if t is range:
            return '["r",%s,%s,%s]' % (hexint(v.start), hexint(v.stop), hexint(v.step))
        if t is bytearray:
            return '["ba","%s"]' % bytes(v).hex()
        m = mods.get("collections")
        if m is not None:
            if t is m.Counter:
                return '["Ct",%s]' % pairs(dict.items(v), depth)
            if t is m.OrderedDict:  # its own order (move_to_end), not the underlying dict's
                return '["Od",%s]' % pairs(m.OrderedDict.items(v), depth)
            if t is m.defaultdict:
                f = v.default_factory
                name = FACTORIES.get(f) if f is None or _type(f) is type else None
                if name is None:
                    raise TypeError("unsupported type defaultdict (its default_factory is not a builtin type)")
                return '["dd",%s,%s]' % (name, pairs(dict.items(v), depth))
            od = m.OrderedDict()
            if t is type(od.keys()) or t is type(od.values()):  # an OrderedDict's views, in its order
                tag = "Ovk" if t is type(od.keys()) else "Ovv"
                return '["%s",[%s]]' % (tag, ",".join(enc(x, depth + 1) for x in v))
            if t is type(od.items()):
                return '["Ovi",%s]' % pairs(v, depth)
            if t is m.deque:
                n = v.maxlen
                return '["dq",[%s],%s]' % (",".join(enc(x, depth + 1) for x in v),
                                           "null" if n is None else hexint(n))
        if t.__bases__ == (tuple,) and _isinstance(getattr(t, "_fields", None), tuple) and all(
                k in NT_KEYS or k in t._fields for k in t.__dict__):  # a namedtuple with nothing of its own
            return '["nt",%s,%s,[%s],[%s]]' % (quote(t.__name__), quote(_type.__getattribute__(t, "__module__")),
                                               ",".join(quote(f) for f in t._fields),
                                               ",".join(enc(x, depth + 1) for x in tuple.__iter__(v)))
        m = mods.get("fractions")
        if m is not None and t is m.Fraction:
            return '["q",%s,%s]' % (hexint(v.numerator), hexint(v.denominator))
        m = mods.get("decimal")
        if m is not None and t is m.Decimal:
            text = '["D",%s]' % quote(m.Decimal.__str__(v))
            return nan(v, text) if v.is_nan() else text
        m = mods.get("datetime")
        if m is not None and t in (m.date, m.datetime, m.time, m.timedelta, m.timezone):
            return when(v, t, m)
        m = mods.get("enum")
        if m is not None and _isinstance(v, m.Enum):
            return '["en",%s,%s]' % (enum_class(t, m, depth), enc(v._value_, depth + 1))
        m = mods.get("dataclasses")
        if m is not None and "__dataclass_fields__" in t.__dict__:
            return dataclass(v, t, m, depth)
        if depth == 0 and _isinstance(v, ITER):
            return drain(v)
        raise TypeError("unsupported type " + t.__name__ + (" (a lazy iterator inside a container)"
                                                           if _isinstance(v, ITER) else ""))

    def fn(x):
        return getattr(x, "__func__", x)  # a bound method the metaclass stores (Flag's _iter_member_): its function

    def enum_class(t, m, depth):
        # An Enum class as the trusted side rebuilds it (the functional API: same base, mixin, members), or the
        # standard library's own class; one with methods or properties of its own does not travel
        if t in enums:
            return enums[t]
        base = next(b for b in ("IntFlag", "Flag", "IntEnum", "StrEnum", "Enum") if issubclass(t, getattr(m, b, ())))
        mix = t._member_type_
        members = [(n, x._value_) for n, x in t.__members__.items()]
        own = "mixin " + mix.__name__ if mix not in (object, int, str, float) else ""  # never rebuilt
        if not own:
            kw = {"type": mix} if base == "Enum" and mix is not object else {}
            ref = getattr(m, base)(t.__name__, members, **kw).__dict__
            own = next((k for k, x in t.__dict__.items() if k not in t.__members__ and k not in ENUM_EXTRA and (
                k not in ref or (callable(x) and fn(x) is not fn(ref[k])))), "")  # fmt: skip
        mod = _type.__getattribute__(t, "__module__")
        std = mod.split(".")[0] in STDLIB and getattr(mods.get(mod), t.__qualname__, None) is t
        if own and not std:
            raise TypeError("unsupported type %s (an Enum with its own %s)" % (t.__name__, own))
        # 0: rebuilt; 1: the standard library's class where the check imported it, else rebuilt; 2: that class only
        pairs_ = ",".join('["t",[%s,%s]]' % (quote(n), enc(x, depth + 3)) for n, x in members)
        enums[t] = "%s,%s,%s,%d,%s,[%s]" % (quote(base), quote(t.__qualname__), quote(mod), 2 if own else int(std),
                                            quote(mix.__name__ if not own else "object"), pairs_)  # fmt: skip
        return enums[t]

    def dataclass(v, t, m, depth):
        # A dataclass instance by its fields and parameters; one with a base class or methods of its own (a
        # __post_init__, a property, an __eq__ it wrote) does not travel
        fields = m.fields(v)
        names = {f.name for f in fields}
        made = (m.__file__, "<string>")  # where the dataclass decorator's own methods come from
        def mine(k, x):
            code = getattr(getattr(x, "__wrapped__", x), "__code__", None)  # 3.13: __repr__ under reprlib's wrapper
            return k not in DC_KEYS or callable(x) and getattr(code, "co_filename", "") not in made

        own = "base class" if t.__bases__ != (object,) else next(
            (k for k, x in t.__dict__.items() if k not in names and mine(k, x)), "")  # fmt: skip
        if own:
            raise TypeError("unsupported type %s (a dataclass with its own %s)" % (t.__name__, own))
        p = t.__dataclass_params__
        flags = ",".join("true" if x else "false" for x in (p.eq, p.order, p.frozen, p.unsafe_hash))
        return '["dc",%s,%s,[%s],[%s]]' % (quote(t.__qualname__), quote(_type.__getattribute__(t, "__module__")), flags,
                                           ",".join('[%s,%s,%s,%s]' % (quote(f.name), "true" if f.repr else "false",
                                                                       "true" if f.compare else "false",
                                                                       enc(getattr(v, f.name), depth + 1))
                                                    for f in fields))  # fmt: skip

    def when(v, t, m):
        # date / time values by their fields; a tzinfo only as a fixed-offset timezone (its name if it was given)
        if t is m.timedelta:
            return '["td",%s,%s,%s]' % (hexint(v.days), hexint(v.seconds), hexint(v.microseconds))
        if t is m.timezone:
            args = v.__reduce__()[1]
            return '["tz",%s,%s]' % (when(args[0], m.timedelta, m), quote(args[1]) if len(args) > 1 else "null")
        if t is m.date:
            return '["da",[%s]]' % ",".join(hexint(x) for x in (v.year, v.month, v.day))
        tz = v.tzinfo
        if tz is not None and _type(tz) is not m.timezone:
            raise TypeError("unsupported type " + t.__name__ + " (its tzinfo is not a datetime.timezone)")
        f = (v.hour, v.minute, v.second, v.microsecond, v.fold)
        if t is m.datetime:
            f = (v.year, v.month, v.day) + f
        return '["%s",[%s],%s]' % ("dt" if t is m.datetime else "tm", ",".join(hexint(x) for x in f),
                                   "null" if tz is None else when(tz, m.timezone, m))

    def state():
        # process-wide state the check reads as Python would, in the candidate's process: the decimal context
        # and the int-digit limit (absent: the defaults)
        out = []
        n = sys.get_int_max_str_digits() if INT_DIGITS else 0
        d = mods.get("decimal")
        c = d.getcontext() if d is not None else None
        if c is not None:
            traps = ",".join(sorted(quote(k.__name__) for k, on in c.traps.items() if on))
            ctx = '[%s,%s,%s,%s,%s,%s,[%s]]' % (hexint(c.prec), quote(c.rounding), hexint(c.Emin), hexint(c.Emax),
                                                hexint(c.capitals), hexint(c.clamp), traps)
            if ctx != DEFAULT_CTX:
                out.append('"decimal":' + ctx)
        if n != INT_DIGITS:
            out.append('"int_digits":%s' % hexint(n))
        return ",{%s}" % ",".join(out) if out else ""

    DEFAULT_CTX = ('["1c","ROUND_HALF_EVEN","-f423f","f423f","1","0",'
                   '["DivisionByZero","InvalidOperation","Overflow"]]')

    def frozen(x):
        # an item nothing can change after it was yielded: immutable scalars, tuples / frozensets of them
        t = _type(x)
        if t in SCALARS:
            return True
        return (t is tuple or t is frozenset) and all(frozen(y) for y in x)

    def drain(v):
        # A lazy value, as the assert would consume it: its items now (the call was the assert's last step in the
        # sample), within a list's budgets, and how it ended: exhausted, an exception, or cut. A consumer that
        # keeps the items (list(v)) sees each in its final state, one that reads each as it comes (a
        # comprehension) in its state at yield time: where they differ (one buffer yielded again and again, an
        # item changed later) the value ends, at the first such item, with "changed" - never judged on either.
        kind = ("generator" if _isinstance(v, types.GeneratorType) else "map" if _isinstance(v, map)
                else "filter" if _isinstance(v, filter) else "iterator")
        parts, held, size, end, why = [], [], 0, "end", ""
        it = _iter(v)
        while True:
            try:
                x = _next(it)
            except StopIteration:
                break
            except BaseException as e:
                end, why = "err", (type(e).__name__ + ": " + str(e))[:200]
                break
            if len(parts) >= LAZY_ITEMS or size >= LAZY_BYTES:
                end = "cut"
                break
            parts.append(enc(x, 1))
            size += len(parts[-1])
            if not frozen(x):
                held.append((len(parts) - 1, x))
        for k, x in held:  # after the drain: each mutable item as the consumer would now find it
            try:
                now = enc(x, 1)
            except BaseException as e:
                now = type(e).__name__
            if now != parts[k]:
                end, why = "changed", "item %d (a %s)" % (k, _type(x).__name__)
                del parts[k:]
                break
        return '["it",%s,[%s],%s,%s]' % (quote(kind), ",".join(parts), quote(end), quote(why))

    exec(code, main.__dict__)
    g = main.__dict__
    nested = {x for op in calls if op[2] is not None
              for x in [x for k, x in op[2][0] if k == "r"] + [x for _, k, x in op[2][1] if k == "r"]}

    def run(i):
        # Python's order: the callable (its name in the program's globals, then the attributes), then each
        # argument left to right, a call of the candidate's evaluated there, on the object Python would pass
        root, attrs, call, sent = calls[i]
        if root not in g:  # the program's globals only: a builtin never answers for the candidate
            raise NameError("name %r is not defined" % root)
        obj = g[root]
        for a in attrs:
            obj = getattr(obj, a)
        if call is None:
            return obj
        args, kwargs = [], {}
        for kind, x in call[0]:
            if kind == "s":
                args.extend(x)
            else:
                args.append(run(x) if kind == "r" else x)
        for name, kind, x in call[1]:
            if kind == "d":
                kwargs.update(x)
            else:
                kwargs[name] = run(x) if kind == "r" else x
        return obj(*args, **kwargs)

    for i in range(len(calls)):
        if i in nested or not calls[i][3]:  # an argument of a later call: evaluated there, in Python's order
            continue
        try:
            nans.clear()
            rec = '[%d,"ok",%s%s]' % (i, enc(run(i), 0), state())
        except BaseException as e:  # SystemExit / KeyboardInterrupt too: the value is missing, the run goes on
            rec = '[%d,"err",%s]' % (i, quote((type(e).__name__ + ": " + str(e))[:200]))
        write(out, (rec + "\n").encode())
    for stream in (sys.stdout, sys.stderr):  # os._exit skips the interpreter's own flush
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)

_tdlm_driver()
""".replace("@ELEMENTS@", str(BUDGETS["elements"])).replace("@VALUE_BYTES@", str(BUDGETS["value_bytes"]))
