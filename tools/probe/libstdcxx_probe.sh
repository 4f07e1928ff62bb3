#!/usr/bin/env bash
# Which libstdc++ a C++ extension built here gets, and whether iostreams work in one loaded
# after torch: built plainly and with the private-copy flags the build uses when the compiler
# links libstdc++ statically (CMakeLists.txt, MOECOMM_PRIVATE_LIBSTDCXX).
set -u
CXX=${CXX:-$(command -v g++ || command -v c++)}
PY=${PY:-python3}
echo "compiler: $CXX ($($CXX -dumpfullversion 2>/dev/null))"
for f in libstdc++.so libstdc++.a libstdc++_nonshared.a; do
  echo "$f -> $($CXX -print-file-name=$f)"
done
so=$($CXX -print-file-name=libstdc++.so)
[ -f "$so" ] && head -c 300 "$so" | strings | head -5
ls "$(dirname "$CXX")/../lib64" 2>/dev/null | grep -i stdc | tr '\n' ' '; echo
ldconfig -p 2>/dev/null | grep 'libstdc++' | head -3
"$PY" -c "import torch; print('after import torch:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}))" 2>&1 | tail -1
d=$(mktemp -d)
cat >"$d/p.cc" <<'CC'
#include <sstream>
#include <stdexcept>
#include <string>
extern "C" int probe(char* out, int n) {
  std::ostringstream os;
  os << "n=" << static_cast<long>(12345) << " x=" << 2.5;
  std::string s = os.str();
  try { throw std::runtime_error(s); } catch (const std::exception& e) { s = e.what(); }
  int k = static_cast<int>(s.size()) < n - 1 ? static_cast<int>(s.size()) : n - 1;
  s.copy(out, k); out[k] = 0;
  return k;
}
CC
for mode in plain private; do
  flags=""
  [ $mode = private ] && flags="-static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL"
  $CXX -std=c++17 -O1 -fPIC -shared "$d/p.cc" -o "$d/$mode.so" $flags 2>&1 | tail -3
  echo "== $mode: exports _M_insert: $(nm -D --defined-only "$d/$mode.so" 2>/dev/null | grep -c _M_insert) ; needed: $(readelf -d "$d/$mode.so" | grep NEEDED | grep -o '\[.*\]' | tr '\n' ' ')"
  timeout 60 "$PY" -c "
import ctypes, sys
try:
    import torch  # loads the system libstdc++ first, as in the tests
except ImportError:
    pass
lib = ctypes.CDLL('$d/$mode.so'); buf = ctypes.create_string_buffer(64)
lib.probe(buf, 64); print('  $mode:', buf.value.decode())
" 2>&1 | tail -3
  echo "  $mode rc=$?"
done
