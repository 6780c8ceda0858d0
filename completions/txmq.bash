# txmq completion for bash: generated from the app by `txmq completion bash`; do not edit.
# Install: txmq completion bash > ~/.local/share/bash-completion/completions/txmq
# On each Tab the shell asks `txmq` itself (with _TXMQ_COMPLETE set). Commands when generated:
#   txmq bench
#   txmq broker start
#   txmq broker status
#   txmq checker
#   txmq completion
#   txmq config get
#   txmq config set
#   txmq consume
#   txmq context add
#   txmq context list
#   txmq context remove
#   txmq context show
#   txmq context use
#   txmq discard list
#   txmq discard replay
#   txmq groups describe
#   txmq groups list
#   txmq groups reset
#   txmq groups update
#   txmq inspect half
#   txmq inspect offsets
#   txmq inspect op
#   txmq inspect scheduled
#   txmq inspect tx
#   txmq message find
#   txmq message get
#   txmq migrate
#   txmq read
#   txmq resolve
#   txmq scheduled cancel
#   txmq scheduled list
#   txmq send
#   txmq spark-export
#   txmq stats
#   txmq store repair
#   txmq store verify
#   txmq topics create
#   txmq topics delete
#   txmq topics describe
#   txmq topics update

_txmq_completion() {
    local IFS=$'\n'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   _TXMQ_COMPLETE=complete_bash "$1" ) )
    return 0
}

complete -o default -F _txmq_completion txmq
