# tests/docs_words.cmake: the docs speak of the product only, and quote each
# cost figure from its one source. Run with cmake -DSRC=<source dir> -P.
# Fails on:
#   - process words: an issue number ("issue 19"), "the review", a finding id
#     in parentheses or after "review" ("(D7)", "review N1"), a commit hash
#     (7 to 10 hex characters with a letter and a digit), "this machine";
#   - a command `idemq WORD` in a code span that is not a subcommand of
#     idemq's usage text (consumer/main.c);
#   - a bytes-per-key figure ("188 B per key", "188 bytes per key",
#     "188 B/key") other than ledger_bytes_per_key of docs/figures.txt, unless
#     its line says it is an earlier one ("before", "was").
# The docs: every *.md outside build and state directories, the man page
# template and pages, the sample configs and the systemd files.
cmake_minimum_required(VERSION 3.18)

file(GLOB_RECURSE docs RELATIVE ${SRC} ${SRC}/*.md)
list(FILTER docs EXCLUDE REGEX "^(build[^/]*|\\.state|\\.git|tests/browser/node_modules|tests/node/node_modules|node_modules)/")
list(APPEND docs consumer/idemq.1.in consumer/idemq.1 config/idemq.cfg.5
     config/idemq.service config/idemq.env)
file(GLOB cfgs RELATIVE ${SRC} ${SRC}/config/*.cfg)
list(APPEND docs ${cfgs})

file(STRINGS ${SRC}/docs/figures.txt fig REGEX "^ledger_bytes_per_key=")
string(REGEX REPLACE "^ledger_bytes_per_key=([0-9]+).*" "\\1" bpk "${fig}")
if(NOT bpk MATCHES "^[0-9]+$")
  message(FATAL_ERROR "docs/figures.txt has no ledger_bytes_per_key=N line")
endif()

# The subcommands, from the usage text of `idemq --help`.
file(STRINGS ${SRC}/consumer/main.c usage REGEX "^ +\"  [a-z][a-z-]+[ \\]")
set(commands "")
foreach(u IN LISTS usage)
  string(REGEX REPLACE "^ +\"  ([a-z][a-z-]+).*" "\\1" w "${u}")
  list(APPEND commands ${w})
endforeach()
list(REMOVE_ITEM commands environment exit options)
list(REMOVE_DUPLICATES commands)
string(REPLACE ";" ", " command_text "${commands}")
list(LENGTH commands ncommands)
if(ncommands LESS 10)
  message(FATAL_ERROR "found only ${ncommands} subcommands in consumer/main.c's usage text")
endif()

set(problems "")
set(nfiles 0)
foreach(doc ${docs})
  if(NOT EXISTS ${SRC}/${doc})
    continue()
  endif()
  math(EXPR nfiles "${nfiles} + 1")
  # one list element per line: ';' and brackets would split or join
  # elements, so they become placeholders first
  file(READ ${SRC}/${doc} text)
  string(REPLACE ";" "<sc>" text "${text}")
  string(REPLACE "[" "<lb>" text "${text}")
  string(REPLACE "]" "<rb>" text "${text}")
  string(REPLACE "\\" "<bs>" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    # pad so that a word at either end has a neighbour
    set(l " ${line} ")
    set(hits "")
    if(l MATCHES "[Ii]ssues? #?[0-9]+")
      list(APPEND hits "issue number '${CMAKE_MATCH_0}'")
    endif()
    if(l MATCHES "[Tt]he review|review's|[Rr]eview [DNS][0-9]")
      list(APPEND hits "review '${CMAKE_MATCH_0}'")
    endif()
    if(l MATCHES "[(, ][DNS][0-9][0-9]?[),;:]")
      list(APPEND hits "finding id '${CMAKE_MATCH_0}'")
    endif()
    if(l MATCHES "[Tt]his machine")
      list(APPEND hits "'${CMAKE_MATCH_0}'")
    endif()
    string(REGEX MATCHALL "[^0-9A-Za-z_][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]+[^0-9A-Za-z_]"
           hexes "${l}")
    foreach(h IN LISTS hexes)
      string(LENGTH "${h}" hl)
      if(hl LESS_EQUAL 12 AND h MATCHES "[a-f]" AND h MATCHES "[0-9]")
        list(APPEND hits "commit hash '${h}'")
      endif()
    endforeach()
    string(REGEX MATCHALL "`idemq [a-z][a-z-]*" cmds "${l}")
    foreach(c IN LISTS cmds)
      string(REGEX REPLACE "^`idemq " "" w "${c}")
      if(NOT w IN_LIST commands)
        list(APPEND hits "'idemq ${w}' is no command (idemq --help lists: ${command_text})")
      endif()
    endforeach()
    string(REGEX MATCHALL "[0-9][0-9,]* (B|bytes) per key|[0-9][0-9,]* B/key" figs "${l}")
    foreach(f IN LISTS figs)
      string(REGEX REPLACE "^([0-9,]+).*" "\\1" v "${f}")
      string(REPLACE "," "" v "${v}")
      if(NOT v STREQUAL bpk AND NOT l MATCHES "before|was ")
        list(APPEND hits "'${f}' disagrees with docs/figures.txt (ledger_bytes_per_key=${bpk}): quote it, or say on its line that it is an earlier one")
      endif()
    endforeach()
    foreach(h IN LISTS hits)
      string(APPEND problems "${doc}:${n}: ${h}\n")
    endforeach()
  endforeach()
endforeach()

if(nfiles LESS 10)
  message(FATAL_ERROR "docs_words found only ${nfiles} docs under ${SRC}")
endif()
if(problems)
  message(FATAL_ERROR "the docs must speak of the product only and quote docs/figures.txt:\n${problems}")
endif()
message(STATUS "${nfiles} docs: no process words, every bytes-per-key figure is ${bpk}")
