// The restricted unpickler and the DCP .metadata codec, without LibTorch: round trips, and
// pickles written by hand that are damaged or foreign (Note [Restricted unpickler], Note [DCP
// layout]). tests/distributed_checkpoint_test.cpp checks the same files against Python.

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/pickle.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using pickle::Value;
using namespace std::string_literals;

std::string dcp_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

dcp::Metadata two_tensors_and_a_value() {
  dcp::Metadata m;
  dcp::TensorEntry w;
  w.dtype = "float32";
  w.shape = {5, 3};
  w.chunks = {{Box{{0, 0}, {3, 3}}, {"__0_0.distcp", 0, 1100}},
              {Box{{3, 0}, {2, 3}}, {"__1_0.distcp", 0, 1088}}};
  m.tensors["model.w"] = w;
  dcp::TensorEntry step;
  step.dtype = "int64";
  step.chunks = {{Box{}, {"__0_0.distcp", 1100, 900}}};
  m.tensors["step"] = step;
  m.values["optim.param_groups.0.lr"] = {"__0_0.distcp", 2000, 700};
  m.paths["model.w"] = {"model", "w"};
  m.paths["optim.param_groups.0.lr"] = {"optim", "param_groups", "0", "lr"};
  return m;
}

TEST(DcpMetadata, RoundTrip) {
  const dcp::Metadata m = two_tensors_and_a_value();
  const std::string bytes = dcp::encode_metadata(m, "id-1");
  const dcp::Metadata back = dcp::decode_metadata(bytes, "x/.metadata");
  ASSERT_EQ(back.tensors.size(), 2u);
  const auto& w = back.tensors.at("model.w");
  EXPECT_EQ(w.dtype, "float32");
  EXPECT_EQ(w.shape, (std::vector<int64_t>{5, 3}));
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[1].box, (Box{{3, 0}, {2, 3}}));
  EXPECT_EQ(w.chunks[1].storage, (dcp::StorageInfo{"__1_0.distcp", 0, 1088}));
  EXPECT_EQ(back.tensors.at("step").shape, std::vector<int64_t>{});
  EXPECT_EQ(back.tensors.at("step").chunks[0].storage.offset, 1100);
  EXPECT_EQ(back.values.at("optim.param_groups.0.lr"),
            (dcp::StorageInfo{"__0_0.distcp", 2000, 700}));
  EXPECT_EQ(back.version, "1.0.0");
}

// The tree the reader builds for what the writer wrote: planner_data's digits are integers.
TEST(DcpMetadata, PlannerDataPathsKeepListIndicesAsIntegers) {
  const std::string bytes = dcp::encode_metadata(two_tensors_and_a_value(), "id");
  pickle::ReadOptions o;
  o.allowed_globals = {"torch.distributed.checkpoint.metadata.Metadata",
                       "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
                       "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
                       "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
                       "torch.distributed.checkpoint.metadata.TensorProperties",
                       "torch.distributed.checkpoint.metadata.MetadataIndex",
                       "torch.distributed.checkpoint.metadata.StorageMeta",
                       "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
                       "torch.distributed.checkpoint.filesystem._StorageInfo",
                       "torch.Size",
                       "torch.float32",
                       "torch.int64",
                       "torch.serialization._get_layout"};
  auto root = pickle::read(bytes, o);
  auto planner = root->state->get("planner_data");
  ASSERT_TRUE(planner);
  auto lr = planner->get("optim.param_groups.0.lr");
  ASSERT_TRUE(lr && lr->is(Value::Kind::kTuple));
  ASSERT_EQ(lr->items.size(), 4u);
  EXPECT_TRUE(lr->items[2]->is(Value::Kind::kInt));
  EXPECT_EQ(lr->items[2]->integer, 0);
  auto step = planner->get("step");  // no path given: the key alone
  ASSERT_TRUE(step && step->items.size() == 1);
  EXPECT_EQ(step->items[0]->text, "step");
}

// A pickle that calls os.system (as pickle.dumps of an object whose __reduce__ returns it).
TEST(DcpMetadata, ForeignClassIsRefusedByName) {
  const std::string evil =
      "\x80\x02"
      "cposix\nsystem\nq\x00"
      "X\x07\x00\x00\x00"
      "echo hi\x85R."s;
  const std::string msg = dcp_error([&] { dcp::decode_metadata(evil, "ck/.metadata"); });
  EXPECT_NE(msg.find("cannot read DCP metadata 'ck/.metadata': it names posix.system, which a "
                     "DCP metadata file never holds; refusing it"),
            std::string::npos)
      << msg;
}

TEST(DcpMetadata, DamagedFilesAreErrorsNamingTheFile) {
  const std::string good = dcp::encode_metadata(two_tensors_and_a_value(), "id");
  // Truncated: the reader runs out inside a value or before STOP.
  for (size_t cut : {size_t{1}, size_t{40}, good.size() / 2, good.size() - 1}) {
    const std::string msg = dcp_error([&] { dcp::decode_metadata(good.substr(0, cut), "m"); });
    EXPECT_NE(msg.find("cannot read DCP metadata 'm': "), std::string::npos) << cut << msg;
    EXPECT_NE(msg.find("truncated"), std::string::npos) << cut << msg;
  }
  // A byte of a text-protocol opcode where a binary one belongs.
  std::string flipped = good;
  flipped[2] = 'I';
  EXPECT_NE(dcp_error([&] {
              dcp::decode_metadata(flipped, "m");
            }).find("opcode 0x49 is not one a DCP metadata file uses (a foreign or damaged"),
            std::string::npos);
  EXPECT_NE(dcp_error([&] { dcp::decode_metadata("", "m"); }).find("without a STOP"),
            std::string::npos);
}

// A well-formed pickle of something else: a plain dict, and a Metadata without its storage.
TEST(DcpMetadata, ForeignPicklesAreRefused) {
  pickle::Writer w;
  w.empty_dict();
  const std::string dict = w.finish();
  EXPECT_NE(dcp_error([&] { dcp::decode_metadata(dict, "m"); })
                .find("the file is a dict of 0, not a torch.distributed.checkpoint.metadata."
                      "Metadata"),
            std::string::npos);
  dcp::Metadata m = two_tensors_and_a_value();
  m.tensors["model.w"].chunks[1].storage.relative_path = "../../etc/passwd";
  EXPECT_NE(dcp_error([&] { dcp::decode_metadata(dcp::encode_metadata(m, "i"), "m"); })
                .find("the storage of 'model.w' is '../../etc/passwd' [0, +1088), not a byte "
                      "range of a file in the folder"),
            std::string::npos);
}

// A chunk outside its tensor is a damaged file (an Error naming it), not the caller's mistake.
TEST(DcpMetadata, ChunkOutsideItsTensorIsRefused) {
  dcp::Metadata m = two_tensors_and_a_value();
  m.tensors["model.w"].chunks[1].box = Box{{3, 0}, {3, 3}};
  const std::string msg =
      dcp_error([&] { dcp::decode_metadata(dcp::encode_metadata(m, "i"), "m"); });
  EXPECT_NE(msg.find("cannot read DCP metadata 'm': tensor 'model.w' of shape [5, 3]: a chunk "
                     "[3:6, 0:3] does not fit in it"),
            std::string::npos)
      << msg;
}

TEST(RestrictedUnpickler, RecursiveAndDeepStructuresAreRefused) {
  pickle::ReadOptions o;
  o.source = "p";
  // l = []; l.append(l): EMPTY_LIST, BINPUT 0, BINGET 0, APPEND.
  const std::string self =
      "\x80\x02]q\x00h\x00"
      "a."s;
  EXPECT_NE(dcp_error([&] { pickle::read(self, o); }).find("recursive structure"),
            std::string::npos);
  // 100 nested 1-tuples around None.
  std::string deep = "\x80\x02N";
  deep += std::string(100, '\x85') + ".";
  EXPECT_NE(dcp_error([&] { pickle::read(deep, o); }).find("nested more than 64 deep"),
            std::string::npos);
  o.max_depth = 200;
  EXPECT_EQ(pickle::read(deep, o)->depth, 101);
}

TEST(RestrictedUnpickler, ValuesOfEveryKindRoundTrip) {
  pickle::Writer w;
  w.mark();
  for (int64_t i : {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{70000}, int64_t{-5},
                    int64_t{1} << 40, -(int64_t{1} << 40)}) {
    w.integer(i);
  }
  w.real(-2.5e-8);
  w.string("ü");
  w.boolean(true);
  w.none();
  w.tuple(-1);
  auto v = pickle::read(w.finish(), pickle::ReadOptions{});
  ASSERT_EQ(v->items.size(), 11u);
  EXPECT_EQ(v->items[3]->integer, 70000);
  EXPECT_EQ(v->items[4]->integer, -5);
  EXPECT_EQ(v->items[5]->integer, int64_t{1} << 40);
  EXPECT_EQ(v->items[6]->integer, -(int64_t{1} << 40));
  EXPECT_EQ(v->items[7]->real, -2.5e-8);
  EXPECT_EQ(v->items[8]->text, "ü");
  EXPECT_TRUE(v->items[9]->boolean);
  EXPECT_TRUE(v->items[10]->is(Value::Kind::kNone));
}

}  // namespace
}  // namespace scaletrain
