/* rtp-strategy.h - what the parallel passes share and users never see: the plan that
 * rtp_parallel_new builds (rtp-parallel.c), the interface through which it calls a
 * strategy (ddp, fsdp, rtp, tp: one file each), and the blocks and schedules that rtp and
 * fsdp share (rtp-sched.c).
 *
 * A strategy knows its ranks only through p->comm (rtp_comm_rank/size): run on a group
 * of the world (a pipeline stage's), it must work as it does on the whole. */
#ifndef RTP_STRATEGY_H
#define RTP_STRATEGY_H

#include "rtp-impl.h"

struct rtp_parallel;
struct rtp_move;

/* Stages of a pipeline at most (a stage's bit in a 64-bit mask). */
#define RTP_HETERO_MAX 64

/* What a rank holds of a parameter: along dim, in each of `groups` equal parts, the
 * rows [first, first + len) of the part. */
struct rtp_shard {
  int dim, groups;
  int64_t first, len;
};

/* A strategy: how a one-device forward graph becomes one rank's. The pass clones the
 * leaves (parameters shaped as `shard` says), then every node through `node`, builds
 * backward with the ordinary autodiff (ROT nodes call `backward`), then calls `finish`. */
struct rtp_strategy_i {
  const char *name;
  /* Every rank computes the whole batch's loss (tp): backward is seeded with 1 and the
   * loss needs no reduction. Otherwise each rank's loss is the mean over its own batch. */
  bool whole_batch;
  /* A ZeroPP unit's micro-batches go through each op that reads a parameter together, as
   * one op over their stacked inputs (rtp: one rotation per unit, not per micro-batch). */
  bool unit_ops;
  /* (optional) checks the model and makes the strategy's state (p->state) */
  int (*prepare)(struct rtp_parallel *p);
  /* (optional) what this rank holds of parameter t; NULL: all of it */
  struct rtp_shard (*shard)(const struct rtp_parallel *p, const struct rtp_tensor *t);
  /* (optional) micro-batch m's forward is about to be cloned (its backward follows it) */
  void (*micro)(struct rtp_parallel *p, int m);
  /* (optional) a segment's nodes start (rtp-stage.c: its forward, or its backward, which
   * autodiff builds by itself): no schedule state may tie them to nodes built before */
  void (*segment)(struct rtp_parallel *p);
  /* (optional) the rank node for one-device node i, or NULL to clone it as it is (a
   * NULL with an error recorded in p->ctx is that error) */
  struct rtp_tensor *(*node)(struct rtp_parallel *p, int i, const struct rtp_tensor *t);
  /* (optional) the backward of a ROT node that `node` made: dx (NULL when x needs no
   * gradient) and dp, the gradient of its parameter (src[1]) */
  void (*backward)(struct rtp_parallel *p, struct rtp_tensor *t, struct rtp_tensor *dy,
                   struct rtp_tensor **dx, struct rtp_tensor **dp);
  /* (optional) after backward: gradient buckets, transfers moved */
  int (*finish)(struct rtp_parallel *p);
  /* (optional) the optimizer over this rank's parameters, made: where gradients are
   * shares of the whole, their norm needs the other ranks */
  void (*optimizer)(const struct rtp_parallel *p, struct rtp_optimizer *opt);
};

extern const struct rtp_strategy_i rtp__strategy_ddp, rtp__strategy_fsdp, rtp__strategy_rtp,
    rtp__strategy_tp;

/* The plan: one rank's graph for a one-device forward graph. */
struct rtp_parallel {
  struct rtp_context *ctx;
  struct rtp_comm *comm; /* the ranks the strategy runs on */
  const struct rtp_strategy_i *iface;
  void *state;                /* the strategy's own */
  enum rtp_strategy strategy; /* as asked for (iface is the identity on one rank) */
  enum rtp_type comm_type;    /* rtp: what the travelling copies are (f32 or bf16) */
  enum rtp_type compute_type; /* the precision of every product (f32 or bf16) */
  size_t bucket_bytes;        /* ddp */
  int micro_batches;          /* M: forward and backward cloned M times */
  int accumulate;             /* K computes per optimizer step (rtp_parallel_params) */
  /* With accumulate: the once-a-step reductions the graph leaves out (ddp's), or NULL;
   * planned at its first rtp_parallel_sync. */
  struct rtp_graph *sync;
  const struct rtp_graph *src; /* the one-device forward graph */
  /* The rank tensor of src node i, then of src leaf i: map is the micro-batch being
   * cloned (0 once the plan is made), maps all M in a row. */
  struct rtp_tensor **map, **maps;
  struct rtp_graph *graph;
  struct rtp_tensor *loss, *global_loss;
  struct rtp_rot_hook hook; /* what autodiff calls for the plan's ROT nodes */
  /* Pipelines (rtp-pipeline.c): the pipeline, and which leaves this rank's graph uses
   * (leaf_here[l] == here; NULL: all of them). */
  struct rtp_pipe *pipe;
  const int *leaf_here;
  int here;
  int phases; /* how many times the strategy's `micro` is called: M, or 2M in a pipeline */
  /* rtp_parallel_params.optimizer_in_backward: the optimizer whose nodes the graph runs
   * (rtp-opt-fused.c); the owners' sums then stay where they are computed, not sunk. */
  bool in_backward;
  struct rtp_optimizer *opt;
};

/* Whether this rank's graph uses leaf l of the one-device graph. */
static inline bool rtp__parallel_leaf_here(const struct rtp_parallel *p, int l) {
  return !p->leaf_here || p->leaf_here[l] == p->here;
}

/* Micro-batch m's leaves: its inputs, and (for m = 0) the parameters and constants this
 * rank uses (leaf_stage[l] == stage; leaf_stage NULL: all). */
int rtp__parallel_clone_leaves(struct rtp_parallel *p, int m, const int *leaf_stage, int stage);
/* Node i of the one-device graph into p->map: the strategy's, or a clone. */
int rtp__parallel_clone_node(struct rtp_parallel *p, int i);
/* Index of node t in g's nodes, or -1. */
int rtp__graph_index(const struct rtp_graph *g, const struct rtp_tensor *t);

/* ---- pipelines: rtp-pipeline.c (stages, schedules), rtp-stage.c (a stage's graph) ---- */

/* A tensor of this stage read by a later segment of it (or received from an earlier
 * stage), in micro-batch m: segment q reads it through ph, a view that stops gradients,
 * whose gradient (grad, once q's backward is built) goes back to where it was made. */
struct rtp_xing {
  int m, j, q; /* micro-batch, one-device node, reading segment */
  struct rtp_tensor *ph, *grad;
};

/* Stages of different sizes and strategies (rtp-stage-reshard.c): stage s is job ranks
 * first[s] .. first[s + 1] - 1 of the job communicator, running strat[s]; a step is U
 * units. Each boundary's moves, planned once for all units (lazily), per unit. */
struct rtp_hetero {
  int S, s, g, U; /* stages, this rank's, its rank in it, units of a step */
  int first[RTP_HETERO_MAX + 1];
  enum rtp_strategy strat[RTP_HETERO_MAX];
  int *hosts;             /* per rank of the job communicator: its host (rtp_comm_hosts) */
  struct rtp_move *moves; /* the boundaries' plans so far, a list */
};

/* The stage spec of params checked (the same refusals on every rank, before any
 * transfer), and this rank's place in it; NULL with the error in ctx. */
struct rtp_hetero *rtp__hetero_new(struct rtp_context *ctx,
                                   const struct rtp_parallel_params *params);
/* Micro-batches of stage s a step, and the unit that micro-batch m of rank g of s is. */
int rtp__hetero_micro(const struct rtp_hetero *h, int s);
int rtp__hetero_unit(const struct rtp_hetero *h, int s, int g, int m);
/* Whether stage s holds every unit on each of its ranks (tp, one rank). */
bool rtp__hetero_whole(const struct rtp_hetero *h, int s);
/* The nodes one move appended to the rank's graph (what a forward graph takes along). */
struct rtp_nodes {
  int n;
  struct rtp_tensor **v;
};
/* One-device node j's value for micro-batch m, made on stage a and read on stage c (grad:
 * its gradient, from c back to a): this rank's part of moving it, appended to p->graph
 * (and listed in *rec unless NULL). Send: x is this rank's copy (a stage's rank that is not
 * the chosen sender appends nothing). Recv: the tensor received, shaped as node j; NULL
 * with the error in ctx. */
int rtp__hetero_send(struct rtp_parallel *p, struct rtp_pipe *pp, int j, int a, int c,
                     bool grad, int m, struct rtp_tensor *x, struct rtp_nodes *rec);
struct rtp_tensor *rtp__hetero_recv(struct rtp_parallel *p, struct rtp_pipe *pp, int j, int a,
                                    int c, bool grad, int m, struct rtp_nodes *rec);
/* The micro-batches of this rank's stage whose units are below the least common multiple
 * of the data-parallel stages' sizes: the fewest units whose forwards every stage can run
 * alone, each transfer's two ends both there. */
int rtp__hetero_forward_micro(const struct rtp_hetero *h);

struct rtp_pipe {
  struct rtp_comm *comm;  /* the pipe group: one rank per stage, by stage; NULL: one stage.
                             With het: the job communicator */
  struct rtp_hetero *het; /* stages of different sizes and strategies; NULL: a mesh */
  int S, s, M, U;         /* stages, this one, micro-batches, micro-batches per unit */
  enum rtp_schedule schedule;
  bool recompute;
  /* Per node of the one-device graph: its stage, and its segment: the latest block it
   * depends on (-1: none, the embeddings). A segment's backward runs by itself, from the
   * gradients of what later segments read of it. */
  int *node_stage, *node_seg;
  int *leaf_stage;    /* per leaf: the stage that reads it; -1: none */
  int seg_lo, seg_hi; /* this stage's segments */
  /* Tensors this stage receives (nodes of earlier stages that its nodes read) and sends
   * (its nodes read by later stages, with the stages that read them, a bit each). */
  int n_in, n_out, *in, *out;
  uint64_t *out_to;
  /* Per micro-batch: the recv of each input, the send of each output to each stage, the
   * gradient received for each output; the last stage's losses. */
  struct rtp_tensor **in_recv, **out_send, **out_grad, **losses;
  struct rtp_tensor **last_grad_send;     /* per stage: the last gradient sent back to it */
  struct rtp_nodes *in_nodes, *out_nodes; /* het: the moves of in_recv and out_send */
  struct rtp_xing *xs;                    /* every micro-batch's, heap */
  int n_xs, cap_xs;
};

/* The rank's graph of a pipeline on the pipe group `pipe` (NULL: one stage, for
 * recomputation alone): its stage's nodes for every micro-batch, in the schedule's order. */
int rtp__pipeline_build(struct rtp_parallel *p, struct rtp_comm *pipe, struct rtp_hetero *het,
                        enum rtp_schedule sched, int unit, bool recompute,
                        const int *stage_blocks, int graph_size);
struct rtp_comm *rtp__pipeline_comm(const struct rtp_parallel *p);
/* Into g, this stage's part of micro-batch 0's forward to node i of the one-device graph
 * (rtp_parallel_forward_graph). */
int rtp__pipeline_forward(const struct rtp_parallel *p, int i, struct rtp_graph *g);

/* rtp-stage.c: micro-batch m's forward in three parts: its leaves and the tensors it
 * receives; segment q's nodes (for the micro-batches m0 .. m1 - 1 of a unit); its sends
 * (and the last stage's loss). Its backward: the gradients it receives; segment q's
 * (recomputing its forward first with recompute); the gradients it sends back. */
int rtp__stage_forward_begin(struct rtp_parallel *p, struct rtp_pipe *pp, int m);
int rtp__stage_forward_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int m1,
                               int q);
int rtp__stage_forward_end(struct rtp_parallel *p, struct rtp_pipe *pp, int m);
int rtp__stage_backward_begin(struct rtp_parallel *p, struct rtp_pipe *pp, int m);
int rtp__stage_backward_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int m1,
                                int q);
int rtp__stage_backward_end(struct rtp_parallel *p, struct rtp_pipe *pp, int m);

/* Index of t among src's nodes, then leaves; -1 if it is neither. */
int rtp__parallel_index(const struct rtp_parallel *p, const struct rtp_tensor *t);
/* This rank's tensor for one-device tensor t, or NULL. */
struct rtp_tensor *rtp__parallel_mapped(const struct rtp_parallel *p,
                                        const struct rtp_tensor *t);

/* Whether t is a parameter itself (a leaf), which carries the passes' marks. */
static inline bool rtp__param_leaf(const struct rtp_tensor *t) {
  return t && t->op == RTP_OP_NONE && (t->flags & RTP_FLAG_PARAM);
}

/* Which parameter, if any, node t reads (the first one). */
static inline const struct rtp_tensor *rtp__param_read(const struct rtp_tensor *t) {
  for (int s = 0; s < RTP_MAX_SRC; s++)
    if (t->src[s] && (t->src[s]->flags & RTP_FLAG_PARAM)) return t->src[s];
  return NULL;
}

/* tp's mark on a parameter (rtp_tensor_set_tp): role in op_params word 0, groups in word 1. */
static inline enum rtp_tp_role rtp__tp_role(const struct rtp_tensor *t) {
  return rtp__param_leaf(t) ? (enum rtp_tp_role)t->op_params[0] : RTP_TP_REPLICATED;
}

/* ---- rtp-sched.c: blocks of parameters and the schedules of rtp and fsdp ---------- */

/* What a ROT node applies its parameter block with (op_params[0]); tp's handles are the
 * identity forward with an all-reduce of the gradient (TP_ENTER, Megatron's f) and the
 * all-reduce forward with the identity gradient (TP_REDUCE, Megatron's g). */
enum rtp__rot_kind {
  RTP__ROT_MUL_MAT,
  RTP__ROT_GET_ROWS,
  RTP__ROT_ADD,
  RTP__ROT_MUL,
  RTP__ROT_TP_ENTER,
  RTP__ROT_TP_REDUCE
};

/* Parameters are split along their outermost dimension (PyTorch's first). */
static inline int rtp__param_split_dim(const struct rtp_tensor *p) {
  return rtp_tensor_n_dims(p) - 1;
}
/* Rows [first, first + len) of block s of world blocks of full. */
void rtp__param_block(const struct rtp_tensor *full, int world, int s, int64_t *first,
                      int64_t *len);
/* Elements in full's largest block (block 0): the same number on every rank. */
size_t rtp__param_largest_block(int world, const struct rtp_tensor *full);
/* x's slice [first, first + len) along dim. */
struct rtp_tensor *rtp__slice(struct rtp_context *ctx, struct rtp_tensor *x, int dim,
                              int64_t first, int64_t len);

/* rtp and fsdp: the op that one-device node t applies to parameter full, and its rank
 * operands: x, and the block this rank owns. An error (recorded in p->ctx) for an op
 * that cannot be split. */
int rtp__rot_operands(struct rtp_parallel *p, const struct rtp_tensor *t,
                      const struct rtp_tensor *full, enum rtp__rot_kind *kind,
                      struct rtp_tensor **x, struct rtp_tensor **own);
/* The handle autodiff sees for an op on a distributed parameter: y, as an op of (x, the
 * owned block), whose backward is the strategy's. */
struct rtp_tensor *rtp__rot_handle(struct rtp_parallel *p, const struct rtp_tensor *t,
                                   const struct rtp_tensor *full, enum rtp__rot_kind kind,
                                   struct rtp_tensor *x, struct rtp_tensor *own,
                                   struct rtp_tensor *y);
/* The one-device parameter of a handle (its shape only). */
struct rtp_tensor *rtp__rot_full(const struct rtp_tensor *h);
/* This rank's contribution to the gradient of the block [first, first + len) (shaped like
 * w, which is not read) of a parameter split along dim. */
struct rtp_tensor *rtp__block_grad(struct rtp_context *ctx, enum rtp__rot_kind kind, int dim,
                                   struct rtp_tensor *w, struct rtp_tensor *x,
                                   struct rtp_tensor *dys, int64_t first, int64_t len);
/* Block w's part of dx (NULL where the op has none); for mul_mat, added to the sum of the
 * blocks before (`sum`, NULL for the first). */
struct rtp_tensor *rtp__block_dx(struct rtp_context *ctx, enum rtp__rot_kind kind,
                                 struct rtp_tensor *w, struct rtp_tensor *dys,
                                 struct rtp_tensor *sum);

/* Hops packed into one slot at most: a bound on the transfers in flight. */
#define RTP__PACKED_HOPS 8

/* The travelling copies of rtp and fsdp: two block (fsdp: unit) slots and two gradient
 * slots shared by every op, and what orders the transfers into them. */
struct rtp_sched {
  /* Of comm_type. pool_g holds the largest block; rtp's forward rotation also uses it. */
  struct rtp_tensor *pool_w[2], *pool_g[2];
  size_t pool_elems; /* of the largest block */
  /* The last node that read each slot, so the next write into it waits for it. */
  struct rtp_tensor *w_reader[2], *g_reader[2];
  /* Hops packed into a slot (pack_hop): elements used, hops packed, the last reader
   * before the slot was last emptied (what every hop packed since waits for), and when
   * the slot last took a hop. Slots 0, 1: pool_g; 2, 3: pool_w. */
  size_t used[4];
  int live[4], stamp[4], n_hops;
  struct rtp_tensor *base[4];
  /* The owners' final sums of gradients, which rtp__sched_sink_sums moves late (room for
   * every op of every micro-batch). */
  struct rtp_tensor **sink;
  int n_sink;
  /* Per micro-batch: its first sum in sink, and where its nodes start in the graph: a
   * micro-batch's sums sink no further than the next one's start, so what they read dies
   * before that one's forward. */
  int n_micro, *micro_sink, *micro_start;
};

/* The pool: block slots of w_elems (0: the largest block), gradient slots of the largest
 * block. An error if a parameter has fewer rows than there are ranks. */
int rtp__sched_init(struct rtp_parallel *p, struct rtp_sched *s, size_t w_elems);
/* The pool slot `slot`, from element offs on, seen as block b of full (its shape, the
 * slot's type). */
struct rtp_tensor *rtp__sched_slot_at(struct rtp_parallel *p, struct rtp_tensor *slot,
                                      const struct rtp_tensor *full, int b, size_t offs);
/* Whether blocks of n elements are small: that many fit in one slot. */
static inline bool rtp__sched_small(const struct rtp_sched *s, size_t n) {
  return n * RTP__PACKED_HOPS <= s->pool_elems;
}
static inline struct rtp_tensor *rtp__sched_slot(struct rtp_sched *s, int i) {
  return i < 2 ? s->pool_g[i] : s->pool_w[i - 2];
}
/* The last node that read slot i (a chain: each reader follows the one before). */
static inline struct rtp_tensor **rtp__sched_reader(struct rtp_sched *s, int i) {
  return i < 2 ? &s->g_reader[i] : &s->w_reader[i - 2];
}
/* The slot among [lo, hi) where a hop of n elements lands, the element offset in it, and
 * the node the hop must follow. */
int rtp__sched_pack_hop(struct rtp_sched *s, int lo, int hi, size_t n, size_t *offs,
                        struct rtp_tensor **dep);
/* Micro-batch m starts (before its forward is cloned into g). Its first hop into each slot
 * empties the slot, after the slot's last reader: were it to pack into a slot that the
 * micro-batch before filled, its readers of that slot would not follow that one's sums,
 * which then could sink past the hop that next empties the slot. */
void rtp__sched_micro(struct rtp_sched *s, const struct rtp_graph *g, int m);
/* A segment starts (rtp-stage.c): its first hop into each slot empties the slot. */
void rtp__sched_segment(struct rtp_sched *s);
/* A partial sum of a gradient passed on to rank + 1, while rank - 1's partial sum of
 * block b arrives in a gradient slot (which goes to *slot); `after`: the hop before it. */
struct rtp_tensor *rtp__sched_grad_hop(struct rtp_parallel *p, struct rtp_sched *s,
                                       struct rtp_tensor *send, const struct rtp_tensor *full,
                                       int b, struct rtp_tensor *after, int *slot);
/* The owners' final sums moved late (each with the add that accumulates it into the
 * gradient of the micro-batches before): past at most max_products products (0: no
 * limit), then every ready hop and gather moved early. */
int rtp__sched_sink_sums(struct rtp_graph *g, const struct rtp_sched *s, int max_products);
/* With the optimizer in backward each sum's update follows it and the gradient lives until
 * then, so a sum sinks past one product only: its hop's time to arrive, at no cost to the
 * peak (docs/parallel.md, "The optimizer in backward"). */
#define RTP__SINK_IN_BACKWARD 1
void rtp__graph_hoist_transfers(struct rtp_graph *g);
/* Moves node t (last in g) to just after position at. */
void rtp__graph_move_after(struct rtp_graph *g, int at, struct rtp_tensor *t);

#endif /* RTP_STRATEGY_H */
